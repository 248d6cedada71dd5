"""Sesame CSM through the real tritonserver: a small generated CSM checkpoint (transformers' own
classes, with a tokenizer) and its Mimi, rendered by `tandem-repo --checkpoint --codec`; TEXT in,
Mimi's 24 kHz audio out, from `tts_mono` and from `tts` (P + D), the same frames from both greedy and
seeded, each the frames of the reference loop (`csm_frames.generate`, held to transformers' generate
in tests/unit/test_csm_generation.py) for the front end's prompt."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import load_csm
from tandem.backend.model.csm_frames import generate
from tandem.backend.prompt import TextRequest
from tandem.backend.settings import parse_settings
from tandem.backend.text.frontend import build_frontend, model_config
from tandem.cli import make_repository
from tandem.gateway.client import TTSClient
from tests.support.csm import CODEBOOKS, MIMI_CODES, write_csm, write_mimi
from tests.support.server import TritonProcess
from tests.support.text_models import byte_tokenizer

pytest.importorskip("transformers")
FRAMES = 6
SAMPLES_PER_FRAME = 1920  # Mimi: 24 kHz at 12.5 frames a second
TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def csm_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("csm-models")
    write_csm(root / "csm", seed=8)
    byte_tokenizer().save(str(root / "csm" / "tokenizer.json"))
    write_mimi(root / "mimi", seed=2)
    return root / "csm", root / "mimi"


@pytest.fixture(scope="module")
def csm_server(
    csm_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonProcess]:
    ckpt, mimi = csm_dirs
    work = tmp_path_factory.mktemp("csm-server")
    assert (
        make_repository.main(["--out", str(work / "repo"), "--checkpoint", str(ckpt), "--codec", str(mimi)])
        == 0
    )
    proc = TritonProcess(work / "server")
    proc.repo = work / "repo"
    proc.start(timeout_s=600)
    yield proc
    proc.stop()


def _reference(ckpt: Path, voice: str, params: SamplingParams) -> np.ndarray:
    settings = parse_settings({"model.checkpoint": str(ckpt)})
    fe = build_frontend(settings, model_config(settings), ckpt)
    assert fe is not None
    rows = fe.rows(TextRequest(TEXT, voice))
    model = load_csm(ckpt)
    return generate(model, torch.from_numpy(rows), FRAMES, params, codes=model.shape.mimi_codes).numpy()


@pytest.mark.parametrize(
    ("voice", "sampling", "params"),
    [
        ("", {"TEMPERATURE": 0.0}, SamplingParams()),
        ("1", {"TEMPERATURE": 0.9, "SEED": 5}, SamplingParams(temperature=0.9, seed=5)),
    ],
    ids=["greedy", "seeded"],
)
def test_text_to_mimi_audio_mono_and_pd_alike(
    csm_server: TritonProcess, csm_dirs: tuple[Path, Path], voice: str, sampling: dict, params: SamplingParams
) -> None:
    results = {}
    for model in ("tts_mono", "tts"):
        with TTSClient(csm_server.url, model) as c:
            assert c.model_parameters()["sample_rate"] == "24000"
            r = c.run(None, timeout_s=300, TEXT=TEXT, VOICE=voice, MAX_TOKENS=FRAMES, TOP_P=1.0, **sampling)
        assert r.error is None, (model, r.error)
        assert r.rows is not None and r.rows.shape == (FRAMES, CODEBOOKS + 1)
        assert (r.rows[:, CODEBOOKS] == ABSENT).all() and (r.rows[:, :CODEBOOKS] < MIMI_CODES).all()
        assert r.audio is not None and r.audio.shape == (FRAMES * SAMPLES_PER_FRAME,)
        assert np.abs(r.audio).max() > 0
        results[model] = r
    np.testing.assert_array_equal(results["tts"].rows, results["tts_mono"].rows)
    np.testing.assert_array_equal(
        results["tts_mono"].rows[:, :CODEBOOKS], _reference(csm_dirs[0], voice, params)
    )
