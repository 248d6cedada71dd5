"""CSM generation on the project's decoders: a prompt of a context utterance (text, the reference's
Mimi frames, its end frame) and the text to speak, packed as Sesame lays it out, gives under greedy
decoding exactly the frames transformers' `CsmForConditionalGeneration.generate` gives for the same
conversation (transformers encodes the reference audio with its own Mimi and merges it itself);
seeded sampling is a function of the sampling seed alone, and frames batched together equal frames made alone;
and those frames, streamed through D's framing and the Mimi codec in chunks, sound as transformers'
`generate(output_audio=True)` does (>= 80 dB SNR: the codec's lookback truncation, docs/codecs.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.backend.codec.base import Framing
from tandem.backend.codec.csm import CsmLayout
from tandem.backend.codec.mimi import MimiCodec, mimi_spec
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.model.csm_checkpoint import CsmModel, load_csm
from tandem.backend.model.csm_frames import CsmFrames, frame_rows, generate
from tandem.backend.text.csm import Utterance, prompt_rows
from tests.support.csm import CODEBOOKS, MIMI_CODES, TEXT_VOCAB, write_csm

transformers = pytest.importorskip("transformers")
BOS, EOS, AUDIO, AUDIO_EOS = 1, 4, 2, 3  # the tiny config's ids (tests/support/csm.py)
SAMPLES = 1920 * 5  # five Mimi frames at 24 kHz


@pytest.fixture(scope="module")
def csm(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, CsmModel]:
    path = tmp_path_factory.mktemp("csm")
    model = write_csm(path, seed=5)
    return model, load_csm(path)


def _text(seed: int, n: int) -> np.ndarray:
    body = np.random.default_rng(seed).integers(5, TEXT_VOCAB, size=n)
    return np.concatenate([[BOS], body, [EOS]]).astype(np.int64)


@torch.no_grad()
def test_greedy_frames_equal_transformers_generate(csm: tuple[torch.nn.Module, CsmModel]) -> None:
    model, ours = csm
    audio = torch.from_numpy(np.random.default_rng(1).uniform(-0.5, 0.5, SAMPLES).astype(np.float32))
    codes = model.codec_model.encode(audio[None, None]).audio_codes[0].T  # [F, N], transformers' Mimi
    assert codes.shape == (5, CODEBOOKS) and len(set(codes.flatten().tolist())) > 5
    context, target = _text(2, 6), _text(3, 4)
    ids = np.concatenate([context, [AUDIO] * codes.shape[0], [AUDIO_EOS], target])
    expected = model.generate(
        input_ids=torch.from_numpy(ids)[None],
        input_values=audio[None, None],
        input_values_cutoffs=torch.tensor([[SAMPLES]]),
        # As CsmProcessor passes it: CSM's pad id is its audio id, so an inferred mask would hide the audio.
        attention_mask=torch.ones(1, ids.size, dtype=torch.long),
        max_new_tokens=6,
        do_sample=False,
        depth_decoder_do_sample=False,
    )[0]
    rows = prompt_rows(
        [Utterance(context, codes.numpy()), Utterance(target)], ours.shape.rows, ours.shape.codebook_eos
    )
    assert rows.shape == (ids.size, CODEBOOKS + 1)
    got = generate(ours, torch.from_numpy(rows), 6, SamplingParams())
    assert expected.shape == (6, CODEBOOKS)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@torch.no_grad()
def test_seeded_frames_follow_the_seed_and_not_the_batch(csm: tuple[torch.nn.Module, CsmModel]) -> None:
    _, ours = csm
    rows = torch.from_numpy(prompt_rows([Utterance(_text(4, 5))], ours.shape.rows, ours.shape.codebook_eos))
    hot = SamplingParams(temperature=1.0, seed=9)
    a, b = generate(ours, rows, 4, hot), generate(ours, rows, 4, hot)
    assert torch.equal(a, b)
    assert not torch.equal(a, generate(ours, rows, 4, SamplingParams(temperature=1.0, seed=10)))

    # Three streams' frames in one step equal each made alone.
    h = torch.randn(3, ours.backbone.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    together = CsmFrames(ours, 3).frame(h, params, [0, 4, 7])
    alone = [CsmFrames(ours, 1).frame(h[i : i + 1], [params[i]], [f])[0] for i, f in enumerate((0, 4, 7))]
    assert torch.equal(together, torch.stack(alone))


def test_prompt_rows_refuse_what_does_not_fit(csm: tuple[torch.nn.Module, CsmModel]) -> None:
    _, ours = csm
    rows, eos = ours.shape.rows, ours.shape.codebook_eos
    with pytest.raises(ValueError, match="frames must be"):
        prompt_rows([Utterance(_text(1, 2), np.zeros((3, CODEBOOKS - 1), np.int64))], rows, eos)
    with pytest.raises(ValueError, match="codes must lie"):
        prompt_rows([Utterance(_text(1, 2), np.full((3, CODEBOOKS), rows.codebook_vocab))], rows, eos)
    with pytest.raises(ValueError, match="text ids must lie"):
        prompt_rows([Utterance(np.array([TEXT_VOCAB]))], rows, eos)


@torch.no_grad()
def test_streamed_speech_sounds_as_transformers_audio(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A CSM whose vocabulary is Mimi's 64 codes (the special ids inside it): random weights would
    # otherwise sample CSM's extra ids, which no Mimi decodes (a trained CSM does not emit them).
    path = tmp_path_factory.mktemp("csm64")
    model = write_csm(path, seed=7, depth_override={"vocab_size": MIMI_CODES}, vocab_size=MIMI_CODES,
                      codebook_pad_token_id=MIMI_CODES - 1)  # fmt: skip
    ours = load_csm(path)
    text = _text(6, 5)
    expected = model.generate(
        input_ids=torch.from_numpy(text)[None],
        attention_mask=torch.ones(1, text.size, dtype=torch.long),
        max_new_tokens=12,
        do_sample=False,
        depth_decoder_do_sample=False,
        output_audio=True,
    )[0].numpy()
    rows = torch.from_numpy(prompt_rows([Utterance(text)], ours.shape.rows, ours.shape.codebook_eos))
    generated = frame_rows(generate(ours, rows, 12, SamplingParams())).numpy()
    mimi = tmp_path_factory.mktemp("mimi")
    model.codec_model.save_pretrained(mimi)  # the checkpoint's own Mimi, as a codec directory
    codec = MimiCodec(mimi, mimi_spec(mimi, "csm", 8, 0, 1), torch.device("cpu"))
    track = Framing(CsmLayout(ours.shape.codebook_eos), 8, 0).track(CODEBOOKS + 1)
    parts = []
    for at in range(0, generated.shape[0], 3):
        track.push(generated[at : at + 3])
        parts.extend(codec.decode([track.window(final=at + 3 >= generated.shape[0])]))
    streamed = np.concatenate(parts)
    assert expected.shape == streamed.shape == (12 * 1920,) and np.abs(expected).max() > 0
    err = np.sum((streamed - expected).astype(np.float64) ** 2)
    assert 10 * np.log10(np.sum(expected.astype(np.float64) ** 2) / max(err, 1e-30)) >= 80.0
