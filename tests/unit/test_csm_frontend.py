"""CSM's text front end: a CSM checkpoint's directory (its config.json and tokenizer.json) gives the
backbone's config with its text column, the csm template, and TEXT + VOICE (a speaker number) as the
segment transformers' chat template writes (``<|begin_of_text|>[speaker]text<|end_of_text|>``), one
text row per token with the codebook columns absent, which request validation accepts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.backend.errors import InvalidInput
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import load_csm
from tandem.backend.prompt import TextRequest, check_prompt
from tandem.backend.settings import parse_settings
from tandem.backend.text.frontend import Family, TextFrontend, build_frontend, model_config
from tandem.backend.text.tokenizer import TextTokenizer
from tests.support.csm import CODEBOOKS, TEXT_VOCAB, write_csm
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
