"""The text front end: Orpheus' prompt template (as `orpheus_tts/engine_class.py` `_format_prompt`
builds it), the plain template of the CPU default, family detection, and every bad text input refused
with INVALID_ARG naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.errors import InvalidInput
from tandem.backend.model.config import preset
from tandem.backend.prompt import TextRequest, check_text_request
from tandem.backend.settings import Limits, parse_settings
from tandem.backend.text.frontend import Family, TextFrontend, build_frontend, detect_family, parse_family
from tandem.backend.text.tokenizer import TextTokenizer, TokenizerError
from tests.support.text_models import (
    CHECKED_IN_TOKENIZER,
    ORPHEUS_VOICES,
    checked_in_tokenizer_text,
    llama3_tokenizer,
    orpheus_config,
)

TINY = preset("tiny")
ORPHEUS = orpheus_config()


@pytest.fixture(scope="module")
def orpheus_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    llama3_tokenizer().save(str(path))
    return TextTokenizer.load(path)


@pytest.fixture(scope="module")
def byte_tok() -> TextTokenizer:
    return TextTokenizer.load(CHECKED_IN_TOKENIZER)


def test_checked_in_tokenizer_is_the_generated_one() -> None:
    assert CHECKED_IN_TOKENIZER.read_text() == checked_in_tokenizer_text()


def test_orpheus_template(orpheus_tok: TextTokenizer) -> None:
    fe = TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits())
    text = "Hello there, how are you?"
    encoded = orpheus_tok.encode(f"tara: {text}")
    assert encoded[0] == 128000  # the tokenizer's own BOS, from its post-processor
    ids = fe.ids(TextRequest(text, "tara"))
    assert ids == [128259, *encoded, 128009, 128260, 128261, 128257]
    rows = fe.rows(TextRequest(text, "tara"))
    assert rows.dtype == np.int64 and rows.shape == (len(ids), 1) and rows.flags.c_contiguous
    assert rows[:, 0].tolist() == ids
    # no voice: the text alone
    assert fe.ids(TextRequest(text, "")) == [
        128259,
        *orpheus_tok.encode(text),
        128009,
        128260,
        128261,
        128257,
    ]


def test_plain_template_fills_column_zero(byte_tok: TextTokenizer) -> None:
    fe = TextFrontend(byte_tok, Family.PLAIN, TINY, Limits())
    rows = fe.rows(TextRequest("héllo", "ana"))
    expected = byte_tok.encode("ana: héllo")
    assert expected[0] == 256 and len(expected) == 1 + len("ana: héllo".encode())
    assert rows.shape == (len(expected), TINY.row_width)
    assert rows[:, 0].tolist() == expected and not rows[:, 1:].any()


def test_family_detection(orpheus_tok: TextTokenizer, byte_tok: TextTokenizer) -> None:
    assert detect_family(orpheus_tok, ORPHEUS) == Family.ORPHEUS
    assert detect_family(byte_tok, TINY) == Family.PLAIN
    # Orpheus' tokenizer on a model without room for the audio ids is no Orpheus model
    small = orpheus_config(vocab_size=128266)
    assert detect_family(orpheus_tok, small) == Family.PLAIN
    assert parse_family("orpheus", orpheus_tok, ORPHEUS) == Family.ORPHEUS
    assert parse_family("plain", orpheus_tok, ORPHEUS) == Family.PLAIN
    with pytest.raises(ValueError, match=r"unknown tandem\.frontend\.family 'llasa'"):
        parse_family("llasa", orpheus_tok, ORPHEUS)


def test_tokenizer_that_cannot_serve_the_model_is_a_load_error(
    orpheus_tok: TextTokenizer, byte_tok: TextTokenizer, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="past the model's vocabulary of 1024"):
        TextFrontend(orpheus_tok, Family.PLAIN, TINY, Limits())
    with pytest.raises(ValueError, match="rows of one id"):
        TextFrontend(byte_tok, Family.ORPHEUS, TINY, Limits())
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        TextTokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"is not a tokenizer\.json"):
        TextTokenizer.load(tmp_path / "bad.json")


def test_voices(orpheus_tok: TextTokenizer) -> None:
    listed = TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits(), voices=ORPHEUS_VOICES)
    listed.rows(TextRequest("hi", "leah"))
    listed.rows(TextRequest("hi", ""))  # no voice is always allowed
    with pytest.raises(InvalidInput, match=r"\[INVALID_ARG\] VOICE 'bob' is not one of this model's voices"):
        listed.rows(TextRequest("hi", "bob"))
    TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits()).rows(TextRequest("hi", "bob"))


def test_text_over_the_row_limit(byte_tok: TextTokenizer) -> None:
    fe = TextFrontend(byte_tok, Family.PLAIN, TINY, Limits(max_prompt_rows=8))
    fe.rows(TextRequest("1234567", ""))  # 7 bytes + BOS
    with pytest.raises(InvalidInput, match="TEXT makes 9 prompt rows; the limit is 8"):
        fe.rows(TextRequest("12345678", ""))


def _b(value: object) -> np.ndarray:
    return np.array([value], dtype=np.object_)


P = np.zeros((3, 4), dtype=np.int64)


@pytest.mark.parametrize(
    ("prompt", "text", "voice", "limit", "needle"),
    [
        (P, _b(b"hi"), None, 64, "exactly one of PROMPT and TEXT, not both"),
        (None, None, None, 64, "exactly one of PROMPT and TEXT; it has neither"),
        (None, None, _b(b"tara"), 64, "VOICE needs TEXT"),
        (P, None, _b(b"tara"), 64, "VOICE goes with TEXT only"),
        (None, _b(b"hi"), None, None, "TEXT is not accepted: this model has no tokenizer"),
        (None, _b(b""), None, 64, "TEXT is empty"),
        (None, _b(b" \n\t"), None, 64, r"TEXT is blank \(only whitespace\)"),
        (None, _b(b"\xff\xfe"), None, 64, r"TEXT is not valid UTF-8 \(byte 0\)"),
        (None, _b(b"x" * 65), None, 64, "TEXT is 65 bytes; the limit is 64"),
        (None, np.array([1], dtype=np.int32), None, 64, "TEXT must be BYTES, got INT32"),
        (None, np.array([b"a", b"b"], dtype=np.object_), None, 64, r"TEXT must have shape \[1\], got \[2\]"),
        (None, _b(b"hi"), _b(b"\xc3"), 64, "VOICE is not valid UTF-8"),
        (None, _b(b"hi"), _b(b"v" * 257), 64, "VOICE is 257 bytes; the limit is 256"),
    ],
)
def test_bad_text_inputs(
    prompt: np.ndarray | None,
    text: np.ndarray | None,
    voice: np.ndarray | None,
    limit: int | None,
    needle: str,
) -> None:
    with pytest.raises(InvalidInput, match=r"^\[INVALID_ARG\] .*" + needle):
        check_text_request(prompt, text, voice, limit)


def test_good_text_inputs() -> None:
    assert check_text_request(P, None, None, None) is None
    assert check_text_request(None, _b("héllo".encode()), None, 64) == TextRequest("héllo", "")
    assert check_text_request(None, _b(b"hi"), _b(b"tara"), 64) == TextRequest("hi", "tara")
    assert check_text_request(None, _b("str element"), None, 64) == TextRequest("str element", "")


def test_build_frontend_finds_the_tokenizer(tmp_path: Path, orpheus_tok: TextTokenizer) -> None:
    settings = parse_settings({"frontend.tokenizer": "tokenizer.json", "frontend.max_text_bytes": "100"})
    fe = build_frontend(settings, TINY, CHECKED_IN_TOKENIZER.parent)
    assert fe is not None and fe.family == Family.PLAIN and fe.max_text_bytes == 100
    assert build_frontend(parse_settings({}), TINY, tmp_path) is None  # no tokenizer: TEXT refused
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"tandem_voices": ["tara", "leo"]}))
    (ckpt / "tokenizer.json").write_bytes(Path(orpheus_tok.source).read_bytes())
    fe = build_frontend(parse_settings({"model.checkpoint": str(ckpt)}), ORPHEUS, tmp_path)
    assert fe is not None and fe.family == Family.ORPHEUS and fe.voices == ("tara", "leo")
    fe = build_frontend(
        parse_settings({"model.checkpoint": str(ckpt), "frontend.voices": "a, b"}), ORPHEUS, "/"
    )
    assert fe is not None and fe.voices == ("a", "b")
    with pytest.raises(ValueError, match=r"unknown parameter 'frontend\.voice'"):
        parse_settings({"frontend.voice": "x"})


def test_tandem_repo_points_the_frontend_at_the_checkpoint(tmp_path: Path) -> None:
    from tandem.backend.model.checkpoint import save_checkpoint
    from tandem.backend.model.decoder import Decoder
    from tandem.cli.make_repository import main
    from tandem.serving.repository import model_parameter

    ckpt = tmp_path / "ckpt"
    save_checkpoint(Decoder.random(TINY, seed=1), ckpt)
    assert main(["--out", str(tmp_path / "repo"), "--checkpoint", str(ckpt)]) == 0
    for model in ("frontend", "prefill", "tts_mono"):
        assert model_parameter(tmp_path / "repo", model, "tandem.model.checkpoint") == str(ckpt.resolve())
    for model in ("frontend", "tts_mono"):  # the checkpoint's own tokenizer.json
        assert model_parameter(tmp_path / "repo", model, "tandem.frontend.tokenizer") == ""
    assert main(["--out", str(tmp_path / "preset"), "--preset", "qwen3-4b-shape"]) == 0
    assert model_parameter(tmp_path / "preset", "frontend", "tandem.model.preset") == "qwen3-4b-shape"
