"""A real codec through the real tritonserver: an Orpheus-layout LM (random weights, 156,940 ids,
W = 1) rendered by `tandem-repo --checkpoint --codec` with SNAC (real 24 kHz config, random weights,
noise off). What the client hears must be SNAC's offline decode of the stream's whole code sequence
(>= 40 dB SNR), from `tts` (chunks decoded by the `vocoder` step, many streams per call) and from
`tts_mono` alike, and both publish the codec's clock.

The LM's head is zero on every non-audio id and large on the audio ids, so a greedy stream is all
audio tokens; the checkpoint ships no tokenizer, and tandem-repo still writes the family, so P and
tts_mono sample under Orpheus' grammar (each token in its slot). Few frames only: SNAC on a 2-core
CPU is slower than real time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.codec.base import CodecWindow
from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.codec.snac import SnacCodec, snac_spec
from tandem.backend.generation.orpheus_ids import AUDIO_BASE, SLOTS
from tandem.backend.generation.orpheus_ids import CODES_PER_SLOT as CODEBOOK
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tandem.cli import make_repository
from tandem.gateway.client import TTSClient, run_concurrent
from tests.support.server import TritonProcess
from tests.support.snac_dir import write_snac_dir

ORPHEUS_V = 156940
TOKENS = 50  # 7 whole frames and a partial one


def _audio_lm(path: Path) -> Path:
    cfg = ModelConfig(
        name="orpheus-layout-tiny",
        vocab_size=ORPHEUS_V,
        row_width=1,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=4096,
        eos_token_id=128258,
    )
    decoder = Decoder.random(cfg, seed=3)
    assert decoder.lm_head is not None
    with torch.no_grad():
        head = decoder.lm_head.weight
        audio = slice(AUDIO_BASE, AUDIO_BASE + SLOTS * CODEBOOK)
        scaled = head[audio] * 8.0
        head.zero_()
        head[audio] = scaled
    save_checkpoint(decoder, path)
    return path


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_snac_dir(tmp_path_factory.mktemp("snac"), noise=False)


@pytest.fixture(scope="module")
def orpheus_server(tmp_path_factory: pytest.TempPathFactory, snac_dir: Path) -> Iterator[TritonProcess]:
    work = tmp_path_factory.mktemp("orpheus")
    ckpt = _audio_lm(work / "ckpt")
    repo = work / "repo"
    # the family is detected from the checkpoint (a Llama with Orpheus' 156,940 ids)
    assert (
        make_repository.main(["--out", str(repo), "--checkpoint", str(ckpt), "--codec", str(snac_dir)]) == 0
    )
    proc = TritonProcess(work / "server")
    proc.repo = repo  # serve what tandem-repo rendered
    proc.start(timeout_s=600)  # as the other Orpheus servers: SNAC warm-up on a loaded 2-core box
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def offline(snac_dir: Path) -> SnacCodec:
    return SnacCodec(snac_dir, snac_spec(snac_dir, "orpheus", 2, 1, 7), torch.device("cpu"))


def _offline_audio(codec: SnacCodec, rows: np.ndarray) -> np.ndarray:
    layout = OrpheusLayout()
    codes = layout.codes(rows, 0)
    frames = layout.codec_order(codes[: codes.shape[0] // 7 * 7].reshape(-1, 7))
    return codec.decode([CodecWindow(frames, 0, 0, frames.shape[0])])[0]


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = (got - ref).astype(np.float64)
    return float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(np.sum(err**2), 1e-30)))


def _prompt(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 128000, size=(24, 1), dtype=np.int64)


def test_both_entries_publish_the_codecs_clock(orpheus_server: TritonProcess) -> None:
    for model in ("tts", "tts_mono"):
        with TTSClient(orpheus_server.url, model) as c:
            p = c.model_parameters()
        assert (p["row_width"], p["vocab_size"], p["sample_rate"], p["rows_per_second"]) == (
            "1",
            str(ORPHEUS_V),
            "24000",
            "82.03125",
        )


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_streamed_audio_is_the_offline_snac_decode(
    orpheus_server: TritonProcess, offline: SnacCodec, model: str
) -> None:
    with TTSClient(orpheus_server.url, model) as c:
        r = c.run(_prompt(1), timeout_s=300, MAX_TOKENS=TOKENS, TEMPERATURE=0.0)
    assert r.error is None and r.rows is not None and r.audio is not None
    assert r.rows.shape == (TOKENS, 1)
    assert np.all((r.rows >= AUDIO_BASE) & (r.rows < AUDIO_BASE + SLOTS * CODEBOOK))
    assert r.audio.shape == (TOKENS // 7 * 2048,)  # every whole frame, the first one included
    assert _snr_db(_offline_audio(offline, r.rows), r.audio) >= 40.0
    assert r.response_rows[0] == 14  # the first chunk is (1 + lookahead) frames: it already sounds
    assert r.first_audio_ns == r.first_response_ns


def test_tts_and_tts_mono_agree(orpheus_server: TritonProcess) -> None:
    results = {}
    for model in ("tts", "tts_mono"):
        with TTSClient(orpheus_server.url, model) as c:
            results[model] = c.run(_prompt(2), timeout_s=300, MAX_TOKENS=21, TEMPERATURE=0.0)
    a, b = results["tts"], results["tts_mono"]
    assert a.error is None and b.error is None
    np.testing.assert_array_equal(a.rows, b.rows)
    assert a.audio is not None and b.audio is not None
    assert _snr_db(b.audio, a.audio) >= 60.0


def test_concurrent_streams_each_hear_their_own_offline_decode(
    orpheus_server: TritonProcess, offline: SnacCodec
) -> None:
    """Chunks of four streams interleave through the vocoder (decoded together in one codec call
    whenever they queue up: tests/unit/test_vocoder_batcher.py); each stream's audio is its own."""
    jobs = [(_prompt(10 + i), {"MAX_TOKENS": 35, "TEMPERATURE": 0.0}) for i in range(4)]
    results = run_concurrent(orpheus_server.url, "tts", jobs, timeout_s=300)
    for r in results:
        assert r.error is None and r.rows is not None and r.audio is not None
        assert r.audio.shape == (35 // 7 * 2048,)
        assert _snr_db(_offline_audio(offline, r.rows), r.audio) >= 40.0
