"""The `voices` engine's bounds that cost nothing to check: a built-in voice's name in any case is
refused, and the store holds at most `max_voices` (registered and pending) before a registration is
UNAVAILABLE; a registration refused for either leaves the store and the queue as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.reference import ReferenceVocoder
from tandem.backend.errors import InvalidInput, Overloaded, TandemError
from tandem.backend.settings import VoiceSettings
from tandem.backend.voices.registrar import VoiceJob, VoiceRegistrar
from tandem.backend.voices.request import Action, VoiceRequest, parse_voice_request
from tandem.backend.voices.store import VoiceRecord, VoiceStore

BUILTIN = ("tara", "leah")


@pytest.mark.parametrize("name", [b"TARA", b"Tara", b"tarA", b"LEAH"])
@pytest.mark.parametrize("action", [b"register", b"delete"])
def test_a_builtin_name_in_any_case_is_refused(name: bytes, action: bytes) -> None:
    inputs = {"ACTION": action, "NAME": name, "TRANSCRIPT": b"Words.", "AUDIO": b"\0" * 8}
    with pytest.raises(InvalidInput, match="is a built-in voice"):
        parse_voice_request(inputs, VoiceSettings(), BUILTIN)


class Answers:
    def __init__(self) -> None:
        self.answers: list[dict[str, object]] = []
        self.errors: list[TandemError] = []

    def answer(self, result: dict[str, object]) -> None:
        self.answers.append(result)

    def fail(self, error: TandemError) -> None:
        self.errors.append(error)


def test_the_store_holds_at_most_max_voices(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    for i in range(3):
        store.add(VoiceRecord(f"v{i}", "Words.", [[1]], "reference", 22050, 1050, 1.0, 16000, 0.0))
    settings = VoiceSettings(max_voices=4, max_pending=4)
    vocoder = ReferenceVocoder(VocoderConfig())
    registrar = VoiceRegistrar(vocoder, 1, store, settings, BUILTIN)  # its thread is not started
    sink = Answers()
    registrar.submit(VoiceJob(VoiceRequest(Action.REGISTER, "v3", "Words.", b"x"), sink))
    assert not sink.errors  # the fourth is queued
    registrar.submit(VoiceJob(VoiceRequest(Action.REGISTER, "v4", "Words.", b"x"), sink))
    (err,) = sink.errors
    assert isinstance(err, Overloaded) and "the limit is 4; delete one first" in str(err)
    assert store.names() == ["v0", "v1", "v2"] and registrar._queue.qsize() == 1
    registrar.submit(VoiceJob(VoiceRequest(Action.DELETE, "v0"), sink))  # room again
    registrar.submit(VoiceJob(VoiceRequest(Action.REGISTER, "v4", "Words.", b"x"), sink))
    assert len(sink.errors) == 1 and registrar._queue.qsize() == 2
