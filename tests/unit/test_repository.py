"""tandem-repo / serving.repository: renders deployments from the one checked-in repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.backend.checkpoint import save_checkpoint
from tandem.backend.config import preset
from tandem.backend.decoder import Decoder
from tandem.cli.make_repository import main
from tandem.serving.repository import render, set_parameter

SOURCE = Path(__file__).resolve().parents[2] / "model_repository"


def _cfg(repo: Path, model: str) -> str:
    return (repo / model / "config.pbtxt").read_text()


def test_gpu_unit_places_p_and_d_and_requires_a_gpu_path(tmp_path):
    out = tmp_path / "repo"
    assert (
        main(
            [
                "--out",
                str(out),
                "--preset",
                "qwen3-4b-shape",
                "--dtype",
                "bfloat16",
                "--prefill-gpus",
                "0",
                "--decode-gpus",
                "1",
                "--mono-gpus",
                "0,1",
                "--set",
                "decode:tandem.transfer.deadline_s=2",
            ]
        )
        == 0
    )
    assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]" in _cfg(out, "prefill")
    assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 1 ] } ]" in _cfg(out, "decode")
    assert "gpus: [ 0 ] }, { kind: KIND_GPU count: 1 gpus: [ 1 ] }" in _cfg(out, "tts_mono")
    for model in ("prefill", "decode"):
        assert 'key: "tandem.transfer.require_path" value { string_value: "cuda_ipc" }' in _cfg(out, model)
        assert 'key: "tandem.model.preset" value { string_value: "qwen3-4b-shape" }' in _cfg(out, model)
    assert 'key: "tandem.transfer.deadline_s" value { string_value: "2" }' in _cfg(out, "decode")
    for published in ("tts", "tts_mono"):  # the 4B shape is a plain token LM: W = 1, V = 151936
        assert 'key: "row_width" value { string_value: "1" }' in _cfg(out, published)
        assert 'key: "vocab_size" value { string_value: "151936" }' in _cfg(out, published)
    assert _cfg(out, "vocoder") == _cfg(SOURCE, "vocoder")  # untouched models are copied as they are


def test_checkpoint_publishes_its_own_shape(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_checkpoint(Decoder.random(preset("tiny"), "cpu", seed=3), ckpt)
    out = tmp_path / "repo"
    assert main(["--out", str(out), "--checkpoint", str(ckpt)]) == 0
    assert f'string_value: "{ckpt.resolve()}"' in _cfg(out, "prefill")
    assert 'key: "row_width" value { string_value: "4" }' in _cfg(out, "tts")
    assert "KIND_CPU" in _cfg(out, "decode")  # no GPUs asked for: placement and path stay as checked in
    assert 'key: "tandem.transfer.require_path" value { string_value: "host_shm" }' in _cfg(out, "decode")


def test_bad_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="no model 'nope'"):
        render(SOURCE, tmp_path / "a", {"nope": {"tandem.device": "cpu"}})
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "b"), "--set", "decode-without-equals"])


def test_set_parameter_replaces_or_appends():
    text = 'parameters { key: "a" value { string_value: "1" } }\n'
    assert set_parameter(text, "a", "2") == 'parameters { key: "a" value { string_value: "2" } }\n'
    assert set_parameter(text, "b", "3").endswith('parameters { key: "b" value { string_value: "3" } }\n')
