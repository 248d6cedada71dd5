"""tandem-repo / serving.repository: renders deployments from the one checked-in repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.backend.codec.builder import layout
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tandem.cli.make_repository import main
from tandem.serving.repository import render, set_io, set_parameter
from tandem.serving.triton_io import check_dims
from tandem.wire.contract import MODELS, TTS, Shape, Widths

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
    # every row tensor is [-1, W] for the model's W (one variable dimension: see check_dims)
    for model in ("frontend", "prefill", "tts", "tts_mono"):
        assert '{ name: "PROMPT" data_type: TYPE_INT64 dims: [ -1, 1 ]' in _cfg(out, model)
    for model in ("decode", "vocoder"):
        assert '{ name: "TOKENS" data_type: TYPE_INT64 dims: [ -1, 1 ] }' in _cfg(out, model)
        assert '{ name: "CODES" data_type: TYPE_INT64 dims: [ -1, 1 ] }' in _cfg(out, model)
    # otherwise untouched models are copied as they are
    assert _cfg(out, "vocoder") == _cfg(SOURCE, "vocoder").replace("dims: [ -1, 4 ]", "dims: [ -1, 1 ]")


def test_checked_in_configs_have_one_variable_dimension_per_input_and_the_tiny_width():
    """What every stub checks when it loads (serving/triton_io.check_dims), on the checked-in files."""
    for model, spec in MODELS.items():
        text = _cfg(SOURCE, model)
        for name in spec.names(Shape.ROWS):
            assert f'{{ name: "{name}" data_type: TYPE_INT64 dims: [ -1, 4 ]' in text, (model, name)
        for dims in re.findall(r"dims: \[([^\]]*)\]", text):
            assert dims.count("-1") <= 1, (model, dims)


def test_a_config_that_lets_a_negative_dimension_through_does_not_load():
    two = {"name": "tts_mono", "input": [{"name": "PROMPT", "dims": ["-1", "-1"]}]}
    with pytest.raises(ValueError, match="'PROMPT' has dims \\[-1, -1\\]; at most one may be -1"):
        check_dims(two)
    narrow = {"name": "tts_mono", "input": [{"name": "PROMPT", "dims": ["-1", "4"]}]}
    check_dims(narrow)
    with pytest.raises(ValueError, match="rows are 1 wide; render the repository with tandem-repo"):
        check_dims(narrow, row_width=1)
    check_dims(narrow, row_width=4)


def test_every_checked_in_config_is_the_wire_contract_at_the_tiny_widths():
    """Each model's inputs and outputs in model_repository/ are what the renderer writes from
    wire/contract.py for the checked-in tiny preset (rows of 4 ids; the reference codec's frames are
    its rows), byte for byte, and every model of the repository has a contract."""
    tiny = preset("tiny")
    widths = Widths(tiny.row_width, layout("rows").frame_width(tiny.row_width))
    assert {p.parent.name for p in SOURCE.glob("*/config.pbtxt")} == set(MODELS)
    for model, spec in MODELS.items():
        text = _cfg(SOURCE, model)
        assert set_io(text, spec, widths) == text, model


def test_set_io_writes_the_contract_at_the_given_widths():
    text = _cfg(SOURCE, "tts")
    out = set_io(text, TTS, Widths(row_width=7, frame_width=3))
    assert '{ name: "PROMPT" data_type: TYPE_INT64 dims: [ -1, 7 ] optional: true }' in out
    assert '{ name: "TOKENS" data_type: TYPE_INT64 dims: [ -1, 7 ] }' in out
    assert '{ name: "SEED" data_type: TYPE_INT64 dims: [ 1 ] optional: true }' in out
    assert out.replace("[ -1, 7 ]", "[ -1, 4 ]") == text  # nothing else moved
    with pytest.raises(ValueError, match="no input"):
        set_io('name: "tts"\n', TTS, Widths(1, 1))


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


def test_a_parameter_with_quotes_round_trips_through_the_config() -> None:
    """A JSON value (the fault drills' options) is escaped as text-format wants, and read back as it was;
    unescaped, its quotes ended the string and Triton refused the whole config."""
    from tandem.serving.repository import get_parameter, set_parameter

    value = '{"delay_every": 3, "path": "C:\\\\x"}\nsecond line'
    config = set_parameter('name: "prefill"\n', "tandem.faults.options", value)
    assert '\\"delay_every\\"' in config and get_parameter(config, "tandem.faults.options") == value
    again = set_parameter(config, "tandem.faults.options", "{}")
    assert get_parameter(again, "tandem.faults.options") == "{}" and again.count("tandem.faults.options") == 1


def test_max_batch_zero_is_rendered_for_d_to_size_from_its_pool(tmp_path):
    out = tmp_path / "repo"
    assert main(["--out", str(out), "--max-batch", "0"]) == 0
    for model in ("decode", "tts_mono"):
        assert (
            'key: "tandem.batch.max_batch" value { string_value: "0" }'
            in (out / model / "config.pbtxt").read_text()
        )
