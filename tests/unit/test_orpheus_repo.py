"""`tandem-repo --codec` / `--family orpheus`: the family is recognised from the checkpoint's files,
the codec goes to every process that frames or decodes audio, the codec's clock is published, chunks
are whole frames; and the client's text request carries TEXT/VOICE instead of PROMPT."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.codec.snac import SNAC_24KHZ
from tandem.backend.generation.grammar import Grammar
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.settings import parse_settings
from tandem.backend.text.defaults import load_generation_defaults
from tandem.backend.text.families import detect_family
from tandem.backend.text.frontend import model_config
from tandem.cli.make_repository import main
from tandem.gateway.client import build_inputs
from tandem.serving.repository import get_parameter, model_parameter

_ORPHEUS_LIKE = ModelConfig(
    name="orpheus-like",
    vocab_size=156940,
    row_width=1,
    hidden_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    intermediate_size=32,
)


def _codec_dir(path: Path) -> Path:
    """config.json + an (empty) pytorch_model.bin: rendering reads the config only."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SNAC_24KHZ))
    (path / "pytorch_model.bin").write_bytes(b"")
    return path


def _checkpoint(path: Path, cfg: ModelConfig = _ORPHEUS_LIKE) -> Path:
    save_checkpoint(Decoder.random(cfg), path)
    return path


def _tokenizer(path: Path, name_128266: str) -> None:
    added = [{"id": 128266, "content": name_128266, "special": True}]
    (path / "tokenizer.json").write_text(json.dumps({"added_tokens": added, "model": {"vocab": {}}}))


def test_orpheus_is_detected_from_its_vocabulary_and_tokenizer(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert detect_family(ckpt) == "orpheus"  # a Llama with 156,940 ids and no tokenizer shipped
    _tokenizer(ckpt, "<custom_token_10>")
    assert detect_family(ckpt) == "orpheus"
    _tokenizer(ckpt, "<|reserved_special_token_10|>")
    assert detect_family(ckpt) is None  # that vocabulary is not Orpheus' audio
    assert detect_family(_checkpoint(tmp_path / "tiny", preset("tiny"))) is None
    assert detect_family(tmp_path / "nowhere") is None


def test_an_orpheus_repository_gets_snac_everywhere_and_publishes_its_clock(tmp_path: Path) -> None:
    ckpt, snac, out = _checkpoint(tmp_path / "ckpt"), _codec_dir(tmp_path / "snac"), tmp_path / "repo"
    assert (
        main(["--out", str(out), "--checkpoint", str(ckpt), "--codec", str(snac), "--vocoder-gpus", "0"]) == 0
    )
    for model in ("decode", "vocoder", "tts_mono"):
        assert model_parameter(out, model, "tandem.codec.kind") == "snac"
        assert model_parameter(out, model, "tandem.codec.path") == str(snac.resolve())
        assert model_parameter(out, model, "tandem.codec.layout") == "orpheus"
    assert model_parameter(out, "prefill", "tandem.codec.kind") is None  # P makes no audio
    for model in ("tts", "tts_mono"):
        assert model_parameter(out, model, "sample_rate") == "24000"
        assert model_parameter(out, model, "rows_per_second") == "82.03125"
        assert model_parameter(out, model, "row_width") == "1"
        assert model_parameter(out, model, "vocab_size") == "156940"
    # first chunk: 1 + lookahead frames; grown: 16 frames (the vocoder warms the windows they cut)
    for model in ("decode", "tts_mono", "vocoder"):
        assert model_parameter(out, model, "tandem.batch.first_chunk_rows") == "14"
        assert model_parameter(out, model, "tandem.batch.max_chunk_rows") == "112"
    assert "KIND_GPU" in (out / "vocoder" / "config.pbtxt").read_text()
    assert model_parameter(out, "vocoder", "tandem.torch_threads") == "1"  # one SNAC thread beside D's
    for model in ("prefill", "tts_mono"):  # a request naming no length: Orpheus' own default
        assert model_parameter(out, model, "tandem.limits.default_new_rows") == "1200"
    for model in ("decode", "vocoder"):  # one id per row; a SNAC frame is 7 codes (1 + 2 + 4)
        text = (out / model / "config.pbtxt").read_text()
        assert '{ name: "TOKENS" data_type: TYPE_INT64 dims: [ -1, 1 ] }' in text
        assert '{ name: "CODES" data_type: TYPE_INT64 dims: [ -1, 7 ] }' in text


def test_the_default_repository_keeps_the_reference_codec(tmp_path: Path) -> None:
    out = tmp_path / "repo"
    assert main(["--out", str(out)]) == 0
    assert model_parameter(out, "vocoder", "tandem.codec.kind") == "reference"
    assert model_parameter(out, "tts", "rows_per_second") == "21"
    assert model_parameter(out, "tts", "sample_rate") == "22050"


def test_a_family_without_its_codec_or_with_a_bad_one_is_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="needs its codec"):
        main(["--out", str(tmp_path / "a"), "--checkpoint", str(ckpt)])
    with pytest.raises(SystemExit, match="needs its codec"):
        main(["--out", str(tmp_path / "b"), "--preset", "tiny", "--family", "orpheus"])
    with pytest.raises(SystemExit, match="the orpheus family needs its codec"):
        main(["--out", str(tmp_path / "b2"), "--preset", "orpheus-3b-shape"])
    with pytest.raises(SystemExit, match=r"codec\.path"):
        main(["--out", str(tmp_path / "c"), "--checkpoint", str(ckpt), "--codec", str(tmp_path / "none")])
    bad = _codec_dir(tmp_path / "snac")
    with pytest.raises(SystemExit, match="W=4"):
        main(["--out", str(tmp_path / "d"), "--preset", "tiny", "--family", "orpheus", "--codec", str(bad)])


def test_a_text_request_carries_text_and_voice_and_no_prompt() -> None:
    inputs = build_inputs(None, TEXT="Hello there.", VOICE="tara", MAX_TOKENS=1200)
    by_name = {i.name(): i for i in inputs}
    assert set(by_name) == {"TEXT", "VOICE", "MAX_TOKENS"}
    assert (by_name["TEXT"].datatype(), by_name["TEXT"].shape()) == ("BYTES", [1])
    assert by_name["VOICE"].datatype() == "BYTES"
    with_prompt = build_inputs(np.zeros((3, 1), dtype=np.int64), VOICE_ID="v1")
    assert [i.name() for i in with_prompt] == ["PROMPT", "VOICE_ID"]


ORPHEUS_FT_VOICES = "tara,leah,jess,leo,dan,mia,zac,zoe"


def test_orpheus_voices_are_written_for_every_model_that_speaks_or_registers(tmp_path: Path) -> None:
    """A real Orpheus checkpoint lists no voices (no `tandem_voices`): tandem-repo writes the fine-tuned
    model's eight, so `bob` is refused; `--voices` overrides; the codec goes to `voices` (its encoder);
    `--voices-dir` names one store for all of them."""
    ckpt, codec = _checkpoint(tmp_path / "ckpt"), _codec_dir(tmp_path / "snac")
    out = tmp_path / "repo"
    assert (
        main(["--out", str(out), "--checkpoint", str(ckpt), "--codec", str(codec), "--voices-dir", "/srv/v"])
        == 0
    )
    for model in ("frontend", "tts_mono", "voices"):
        assert model_parameter(out, model, "tandem.frontend.voices") == ORPHEUS_FT_VOICES
        assert model_parameter(out, model, "tandem.voices.dir") == "/srv/v"
    assert model_parameter(out, "voices", "tandem.codec.kind") == "snac"
    assert model_parameter(out, "voices", "tandem.model.checkpoint") == str(ckpt.resolve())
    other = tmp_path / "other"
    assert (
        main(["--out", str(other), "--checkpoint", str(ckpt), "--codec", str(codec), "--voices", "ana,bo"])
        == 0
    )
    assert model_parameter(other, "frontend", "tandem.frontend.voices") == "ana,bo"


def test_a_preset_keeps_the_checked_in_voices(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "repo"), "--preset", "tiny"]) == 0
    for model in ("frontend", "tts_mono", "voices"):
        assert model_parameter(tmp_path / "repo", model, "tandem.frontend.voices") == ORPHEUS_FT_VOICES


def _served_grammar(repo: Path, model: str) -> Grammar:
    """The grammar `model` of the rendered `repo` samples under: its every tandem.* parameter parsed
    as the stub parses them, then the generation defaults the stub builds (no tokenizer here, so no
    text front end, as in the served model)."""
    text = (repo / model / "config.pbtxt").read_text()
    keys = re.findall(r'parameters \{ key: "tandem\.([^"]+)"', text)
    settings = parse_settings({k: str(get_parameter(text, f"tandem.{k}")) for k in keys})
    return load_generation_defaults(settings, model_config(settings), None).grammar


def test_an_orpheus_repository_samples_under_the_grammar_without_a_tokenizer(tmp_path: Path) -> None:
    """Neither the `orpheus-3b-shape` preset nor a checkpoint without tokenizer.json lets the text
    front end detect the family: tandem-repo writes it, so P and tts_mono (which hand the grammar to
    D) sample audio ids from the first token; an explicit `--set ...grammar=off` still wins."""
    snac = _codec_dir(tmp_path / "snac")
    shape = tmp_path / "shape"
    argv = ["--out", str(shape), "--preset", "orpheus-3b-shape", "--family", "orpheus", "--codec", str(snac)]
    assert main(argv) == 0
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert not (ckpt / "tokenizer.json").exists()
    detected = tmp_path / "detected"
    assert main(["--out", str(detected), "--checkpoint", str(ckpt), "--codec", str(snac)]) == 0
    preset_alone = tmp_path / "preset"  # the Orpheus shape is an Orpheus model: no --family needed
    assert main(["--out", str(preset_alone), "--preset", "orpheus-3b-shape", "--codec", str(snac)]) == 0
    for repo in (shape, detected, preset_alone):
        for model in ("prefill", "tts_mono"):
            assert _served_grammar(repo, model) == Grammar.ORPHEUS, (repo.name, model)
    off = tmp_path / "off"
    assert main([*argv[:1], str(off), *argv[2:], "--set", "prefill:tandem.frontend.grammar=off"]) == 0
    assert _served_grammar(off, "prefill") == Grammar.NONE
    assert _served_grammar(off, "tts_mono") == Grammar.ORPHEUS
    plain = tmp_path / "plain"
    assert main(["--out", str(plain), "--preset", "tiny"]) == 0
    assert _served_grammar(plain, "prefill") == Grammar.NONE  # the CPU default stays as it is
