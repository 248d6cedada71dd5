"""`tandem-repo` recognises a Sesame CSM checkpoint from its config.json, puts Mimi behind every
process that frames or decodes audio, and publishes the backbone's rows (N codes + a text column)
and Mimi's clock (12.5 rows a second, a floor of twice that)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.backend.settings import parse_settings
from tandem.backend.text.families import checkpoint_config, detect_family
from tandem.cli.make_repository import main
from tandem.serving.repository import model_parameter
from tests.support.csm import CODEBOOKS, VOCAB, write_csm, write_mimi

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("csm-repo")
    write_csm(root / "csm", seed=6)
    write_mimi(root / "mimi")
    return root / "csm", root / "mimi"


def test_csm_is_detected_and_its_config_is_the_backbones(dirs: tuple[Path, Path]) -> None:
    ckpt, mimi = dirs
    assert detect_family(ckpt) == "csm"
    assert detect_family(mimi) is None
    cfg = checkpoint_config(ckpt)
    assert (cfg.row_width, cfg.vocab_size, cfg.hidden_size) == (CODEBOOKS + 1, VOCAB, 64)


def test_a_csm_repository_gets_mimi_everywhere_and_publishes_its_clock(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    ckpt, mimi = dirs
    out = tmp_path / "repo"
    assert main(["--out", str(out), "--checkpoint", str(ckpt), "--codec", str(mimi)]) == 0
    for model in ("decode", "vocoder", "tts_mono", "voices"):
        assert model_parameter(out, model, "tandem.codec.kind") == "mimi"
        assert model_parameter(out, model, "tandem.codec.path") == str(mimi.resolve())
        assert model_parameter(out, model, "tandem.codec.layout") == "csm"
    assert model_parameter(out, "prefill", "tandem.codec.kind") is None  # P makes no audio
    for model in ("frontend", "prefill", "tts_mono"):  # Sesame's template, not Orpheus'
        assert model_parameter(out, model, "tandem.frontend.family") == "csm"
    for model in ("tts", "tts_mono"):
        assert model_parameter(out, model, "sample_rate") == "24000"
        assert model_parameter(out, model, "rows_per_second") == "12.5"
        assert model_parameter(out, model, "row_width") == str(CODEBOOKS + 1)
        assert model_parameter(out, model, "vocab_size") == str(VOCAB)
    for model in ("decode", "tts_mono", "vocoder"):  # a frame a row, no lookahead: the first chunk is one row
        assert model_parameter(out, model, "tandem.batch.first_chunk_rows") == "1"
        assert model_parameter(out, model, "tandem.batch.max_chunk_rows") == "16"
    for model in ("prefill", "tts_mono"):
        assert model_parameter(out, model, "tandem.limits.default_new_rows") == "1125"
    for model in ("decode", "vocoder"):  # rows of N codes + text; Mimi frames of N codes
        text = (out / model / "config.pbtxt").read_text()
        assert f'{{ name: "TOKENS" data_type: TYPE_INT64 dims: [ -1, {CODEBOOKS + 1} ] }}' in text
        assert f'{{ name: "CODES" data_type: TYPE_INT64 dims: [ -1, {CODEBOOKS} ] }}' in text
    decode = {
        k.removeprefix("tandem."): v
        for k, v in (
            ("tandem.codec.kind", "mimi"),
            ("tandem.codec.path", str(mimi)),
            ("tandem.codec.layout", "csm"),
        )
    }
    assert parse_settings(decode).batch.rate_floor_tok_s == 25.0


def test_csm_without_mimi_is_refused(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, _ = dirs
    with pytest.raises(SystemExit, match="the csm family needs its codec"):
        main(["--out", str(tmp_path / "a"), "--checkpoint", str(ckpt)])
    snac_like = tmp_path / "snac"
    snac_like.mkdir()
    (snac_like / "config.json").write_text('{"sampling_rate": 24000}')
    (snac_like / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit, match="model_type"):
        main(["--out", str(tmp_path / "b"), "--checkpoint", str(ckpt), "--codec", str(snac_like)])
    with pytest.raises(SystemExit, match="needs a CSM checkpoint"):  # a preset is no CSM
        main(["--out", str(tmp_path / "d"), "--preset", "tiny", "--family", "csm", "--codec", str(snac_like)])


def test_a_csm_checkpoint_whose_parts_disagree_is_refused_by_field(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    import json

    ckpt, mimi = dirs
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    config["depth_decoder_config"]["num_codebooks"] = CODEBOOKS + 1
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match=r"depth_decoder_config\.num_codebooks"):
        main(["--out", str(tmp_path / "c"), "--checkpoint", str(bad), "--codec", str(mimi)])


def test_a_mimi_that_cannot_decode_the_csm_is_refused_by_field(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    import json

    ckpt, mimi = dirs
    for field, value in (("num_quantizers", CODEBOOKS - 1), ("codebook_size", 128), ("sampling_rate", 16000)):
        other = tmp_path / f"mimi-{field}"
        other.mkdir()
        config = json.loads((mimi / "config.json").read_text())
        config[field] = value
        (other / "config.json").write_text(json.dumps(config))
        (other / "model.safetensors").write_bytes((mimi / "model.safetensors").read_bytes())
        with pytest.raises(SystemExit, match=f"field '{field}'"):
            main(["--out", str(tmp_path / f"repo-{field}"), "--checkpoint", str(ckpt), "--codec", str(other)])
