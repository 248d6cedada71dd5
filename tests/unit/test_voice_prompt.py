"""A registered voice's prompt: Orpheus' zero-shot cloning layout as the upstream pretrain notebook
builds it (ids and the 7-token interleave written out here, not taken from the code under test), the
plain family's rows, the prefix first and identical across requests, a deleted or unknown voice
refused naming VOICE and listing the voices; the `voices` request checks; both codecs' encoders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.reference import ReferenceVocoder
from tandem.backend.errors import InvalidInput
from tandem.backend.model.config import preset
from tandem.backend.prompt import TextRequest
from tandem.backend.settings import Limits, VoiceSettings
from tandem.backend.text.frontend import Family, TextFrontend
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.backend.voices.request import Action, parse_voice_request
from tandem.backend.voices.store import VoiceRecord, VoiceStore
from tests.support.text_models import CHECKED_IN_TOKENIZER, ORPHEUS_VOICES, llama3_tokenizer, orpheus_config

ORPHEUS = orpheus_config()
TINY = preset("tiny")


@pytest.fixture(scope="module")
def orpheus_tok(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    llama3_tokenizer().save(str(path))
    return TextTokenizer.load(path)


def voice(
    name: str, frames: np.ndarray, codec: str = "snac", transcript: str = "I read this aloud."
) -> VoiceRecord:
    return VoiceRecord(name, transcript, frames.tolist(), codec, 24000, 2048, 2.0, 16000, 0.0)


def snac_codes(frames: int, seed: int = 0) -> list[np.ndarray]:
    """SNAC 24 kHz's three levels for `frames` frames: [F], [2F], [4F] codes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 4096, size=frames * n) for n in (1, 2, 4)]


def notebook_audio_tokens(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray) -> list[int]:
    """The pretrain notebook's interleave of SNAC's levels into Orpheus tokens, frame by frame."""
    out = []
    for i in range(c0.shape[0]):
        out += [
            128266 + int(c0[i]),
            128266 + int(c1[2 * i]) + 4096,
            128266 + int(c2[4 * i]) + 2 * 4096,
            128266 + int(c2[4 * i + 1]) + 3 * 4096,
            128266 + int(c1[2 * i + 1]) + 4 * 4096,
            128266 + int(c2[4 * i + 2]) + 5 * 4096,
            128266 + int(c2[4 * i + 3]) + 6 * 4096,
        ]
    return out


def test_orpheus_cloning_layout(tmp_path: Path, orpheus_tok: TextTokenizer) -> None:
    c0, c1, c2 = snac_codes(5)
    frames = np.stack(
        [np.concatenate([c0[i : i + 1], c1[2 * i : 2 * i + 2], c2[4 * i : 4 * i + 4]]) for i in range(5)]
    )
    store = VoiceStore(tmp_path)
    store.add(voice("ana", frames))
    fe = TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits(), ORPHEUS_VOICES, store=store)
    rows = fe.rows(TextRequest("A new sentence.", "ana"))
    transcript, text = orpheus_tok.encode("I read this aloud."), orpheus_tok.encode("A new sentence.")
    assert transcript[0] == 128000 and text[0] == 128000  # BOS from the tokenizer, as the notebook's
    expected = [
        128259, *transcript, 128009, 128260, 128261, 128257,
        *notebook_audio_tokens(c0, c1, c2),
        128258, 128262,
        128259, *text, 128009, 128260, 128261, 128257,
    ]  # fmt: skip
    assert rows.shape == (len(expected), 1) and rows[:, 0].tolist() == expected
    other = fe.rows(TextRequest("Something else entirely, and longer.", "ana"))
    prefix = len(expected) - len(text) - 5
    np.testing.assert_array_equal(other[:prefix], rows[:prefix])  # the same prefix leads every request
    builtin = fe.rows(TextRequest("A new sentence.", "tara"))  # built-in voices keep the fine-tuned template
    assert builtin[:, 0].tolist() == [
        128259,
        *orpheus_tok.encode("tara: A new sentence."),
        128009,
        128260,
        128261,
        128257,
    ]


def test_plain_cloning_rows(tmp_path: Path) -> None:
    tok = TextTokenizer.load(CHECKED_IN_TOKENIZER)
    frames = np.random.default_rng(1).integers(0, 192, size=(6, TINY.row_width))
    store = VoiceStore(tmp_path)
    store.add(voice("ana", frames, codec="reference"))
    fe = TextFrontend(tok, Family.PLAIN, TINY, Limits(), ("tara",), store=store)
    rows = fe.rows(TextRequest("hi", "ana"))
    head = tok.encode("I read this aloud.")
    assert rows.shape == (len(head) + 6 + len(tok.encode("hi")), TINY.row_width)
    assert rows[: len(head), 0].tolist() == head and not rows[: len(head), 1:].any()
    np.testing.assert_array_equal(rows[len(head) : len(head) + 6], frames)
    assert rows[len(head) + 6 :, 0].tolist() == tok.encode("hi")


def test_unknown_deleted_and_mismatched_voices_are_refused(
    tmp_path: Path, orpheus_tok: TextTokenizer
) -> None:
    store = VoiceStore(tmp_path)
    store.add(voice("ana", np.zeros((3, 7), dtype=np.int64)))
    store.add(voice("wide", np.zeros((3, 4), dtype=np.int64), codec="reference"))
    fe = TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits(), ORPHEUS_VOICES, store=store)
    fe.rows(TextRequest("hi", "ana"))
    listed = ", ".join([*ORPHEUS_VOICES, "ana", "wide"])
    with pytest.raises(
        InvalidInput, match=rf"^\[INVALID_ARG\] VOICE 'bob' is not one of this model's voices: {listed}$"
    ):
        fe.rows(TextRequest("hi", "bob"))
    with pytest.raises(InvalidInput, match=r"VOICE 'wide' was registered with reference frames of 4 codes"):
        fe.rows(TextRequest("hi", "wide"))
    store.remove("ana")
    with pytest.raises(InvalidInput, match=r"VOICE 'ana' is not one of this model's voices"):
        fe.rows(TextRequest("hi", "ana"))  # the next request after a delete


def test_a_prefix_past_the_prompt_limit_is_refused(tmp_path: Path, orpheus_tok: TextTokenizer) -> None:
    store = VoiceStore(tmp_path)
    store.add(voice("ana", np.zeros((20, 7), dtype=np.int64)))
    fe = TextFrontend(orpheus_tok, Family.ORPHEUS, ORPHEUS, Limits(max_prompt_rows=100), store=store)
    needle = r"TEXT makes 169 prompt rows with the 161-row prefix of VOICE 'ana'; the limit is 100"
    with pytest.raises(InvalidInput, match=needle):
        fe.rows(TextRequest("hi", "ana"))


S = VoiceSettings(max_file_bytes=100, max_transcript_bytes=20)
OK = {"ACTION": b"register", "NAME": b"ana", "TRANSCRIPT": b"hello", "AUDIO": b"RIFF"}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"ACTION": None}, "ACTION is required"),
        ({"ACTION": b"rename"}, "ACTION 'rename' is not one of register, list, delete"),
        ({"NAME": None}, "NAME is required to register a voice"),
        ({"NAME": b"../x"}, "NAME '../x' is not a voice name"),
        ({"NAME": b"\xff"}, "NAME is not valid UTF-8"),
        ({"NAME": b"tara"}, "NAME 'tara' is a built-in voice of this model; it cannot be registered"),
        ({"TRANSCRIPT": None}, "TRANSCRIPT is required"),
        ({"TRANSCRIPT": b"  \n"}, "TRANSCRIPT is required"),
        ({"TRANSCRIPT": b"x" * 21}, "TRANSCRIPT is 21 bytes; the limit is 20"),
        ({"AUDIO": None}, "AUDIO is required"),
        ({"AUDIO": b"x" * 101}, "AUDIO is 101 bytes; the limit is 100"),
        (
            {"ACTION": b"delete", "NAME": b"tara"},
            "NAME 'tara' is a built-in voice of this model; it cannot be deleted",
        ),
    ],
)
def test_voice_requests_refused_naming_the_input(change: dict[str, bytes | None], needle: str) -> None:
    with pytest.raises(InvalidInput, match=r"^\[INVALID_ARG\] " + __import__("re").escape(needle)):
        parse_voice_request({**OK, **change}, S, ("tara",))


def test_voice_requests_accepted() -> None:
    assert parse_voice_request(OK, S, ("tara",)).action is Action.REGISTER
    assert parse_voice_request({"ACTION": b"list"}, S, ()).action is Action.LIST
    got = parse_voice_request({"ACTION": b"delete", "NAME": b"ana"}, S, ())
    assert (got.action, got.name) == (Action.DELETE, "ana")


def test_reference_encoder_inverts_its_synthesis() -> None:
    v = ReferenceVocoder(VocoderConfig())
    rows = np.random.default_rng(0).integers(0, 192, size=(40, 1))
    np.testing.assert_array_equal(v.encode(v.synthesize(rows, 0), 1), rows)
    wide = v.encode(v.synthesize(np.random.default_rng(1).integers(0, 192, size=(40, 4)), 0), 4)
    assert wide.shape == (40, 4) and wide.min() >= 0 and wide.max() < 192  # rows the model can read
