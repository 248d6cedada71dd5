"""CSM's text front end: a CSM checkpoint's directory (its config.json and tokenizer.json) gives the
backbone's config with its text column, the csm template, and TEXT + VOICE (a speaker number) as the
segment transformers' chat template writes (``<|begin_of_text|>[speaker]text<|end_of_text|>``), one
text row per token with the codebook columns absent, which request validation accepts; a registered
voice (Mimi-encoded) is the context utterance before it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.codec.mimi import MimiCodec, mimi_spec
from tandem.backend.errors import InvalidInput
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import load_csm
from tandem.backend.prompt import TextRequest, check_prompt
from tandem.backend.settings import parse_settings
from tandem.backend.text.frontend import Family, TextFrontend, build_frontend, model_config
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.backend.voices.store import VoiceRecord, VoiceStore
from tests.support.csm import CODEBOOKS, TEXT_VOCAB, write_csm, write_mimi
from tests.support.text_models import byte_tokenizer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("csm")
    write_csm(path, seed=1)
    byte_tokenizer().save(str(path / "tokenizer.json"))  # 258 ids: within the text vocabulary of 300
    return path


def _frontend(checkpoint: Path) -> TextFrontend:
    settings = parse_settings({"model.checkpoint": str(checkpoint)})
    fe = build_frontend(settings, model_config(settings), checkpoint)
    assert fe is not None
    return fe


def test_a_csm_checkpoint_gets_the_csm_template_and_its_backbones_config(checkpoint: Path) -> None:
    settings = parse_settings({"model.checkpoint": str(checkpoint)})
    cfg = model_config(settings)
    assert cfg == load_csm(checkpoint).backbone.cfg
    assert cfg.text_vocab_size == TEXT_VOCAB and cfg.row_width == CODEBOOKS + 1
    assert _frontend(checkpoint).family == Family.CSM


@pytest.mark.parametrize(("voice", "speaker"), [("", 0), ("1", 1), ("12", 12)])
def test_text_becomes_sesames_segment_as_text_rows(checkpoint: Path, voice: str, speaker: int) -> None:
    fe = _frontend(checkpoint)
    rows = fe.rows(TextRequest("Hello there.", voice))
    segment = f"<|begin_of_text|>[{speaker}]Hello there.<|end_of_text|>"  # transformers' chat template
    tok = byte_tokenizer()
    expected = tok.encode(segment, add_special_tokens=False).ids
    assert rows.shape == (len(expected), CODEBOOKS + 1)
    np.testing.assert_array_equal(rows[:, -1], expected)
    assert (rows[:, :CODEBOOKS] == ABSENT).all()
    np.testing.assert_array_equal(check_prompt(rows, fe.cfg, fe.limits), rows)


def test_a_voice_that_is_no_speaker_number_is_refused(checkpoint: Path) -> None:
    with pytest.raises(
        InvalidInput,
        match=r"VOICE 'tara' is not one of this model's voices: a speaker number \(0, 1, \.\.\.\)",
    ):
        _frontend(checkpoint).rows(TextRequest("Hello.", "tara"))


def test_the_csm_template_needs_its_text_markers(checkpoint: Path, tmp_path: Path) -> None:
    settings = parse_settings({"model.checkpoint": str(checkpoint)})
    tok = byte_tokenizer()
    tok.save(str(tmp_path / "t.json"))
    plain = TextTokenizer.load(tmp_path / "t.json")
    cfg = model_config(settings)
    TextFrontend(plain, Family.CSM, cfg, settings.limits)  # has both markers
    with pytest.raises(ValueError, match="serves a CSM checkpoint"):
        TextFrontend(plain, Family.PLAIN, cfg, settings.limits)


def test_a_registered_voice_is_its_mimi_frames_as_the_context_utterance(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A voice registered as the registrar encodes it (Mimi's encoder, N quantizers): its transcript
    as speaker 0's segment, its frames, the end frame, then the text to speak as speaker 0's."""
    mimi = tmp_path / "mimi"
    write_mimi(mimi, seed=1)
    codec = MimiCodec(mimi, mimi_spec(mimi, "csm", 8, 0, 1), torch.device("cpu"))
    pcm = np.random.default_rng(0).uniform(-0.5, 0.5, 1920 * 6).astype(np.float32)
    frames = codec.encode(pcm, CODEBOOKS)
    assert frames.shape == (6, CODEBOOKS)
    store = VoiceStore(tmp_path / "voices")
    store.add(VoiceRecord("ref", "It is me.", frames.tolist(), "mimi", 24000, 1920, 0.48, 24000, 0.0))
    settings = parse_settings({"model.checkpoint": str(checkpoint)})
    fe = build_frontend(settings, model_config(settings), checkpoint, store)
    assert fe is not None
    rows = fe.rows(TextRequest("Hello.", "ref"))
    tok = byte_tokenizer()
    context = tok.encode("<|begin_of_text|>[0]It is me.<|end_of_text|>", add_special_tokens=False).ids
    target = tok.encode("<|begin_of_text|>[0]Hello.<|end_of_text|>", add_special_tokens=False).ids
    c, f = len(context), frames.shape[0]
    assert rows.shape == (c + f + 1 + len(target), CODEBOOKS + 1)
    np.testing.assert_array_equal(rows[:c, -1], context)
    np.testing.assert_array_equal(rows[c : c + f, :CODEBOOKS], frames)
    np.testing.assert_array_equal(rows[c + f, :CODEBOOKS], [0] * CODEBOOKS)  # the end frame: eos 0
    assert (rows[c : c + f + 1, -1] == ABSENT).all()
    np.testing.assert_array_equal(rows[c + f + 1 :, -1], target)
    np.testing.assert_array_equal(check_prompt(rows, fe.cfg, fe.limits), rows)
    store.add(VoiceRecord("snac", "x", [[1] * 7], "snac", 24000, 2048, 0.1, 24000, 0.0))
    with pytest.raises(InvalidInput, match="frames of 7 codes; this model's are 8 Mimi codes"):
        fe.rows(TextRequest("Hello.", "snac"))
