"""A `voices` request: what it asks (register, list, delete) and the checks that cost nothing.

The `voices` model's inputs (`wire/contract.py` VOICES), each BYTES [1]: ACTION
(`register`, `list`, `delete`), NAME, TRANSCRIPT (UTF-8) and AUDIO (the reference recording's whole
file, any format FFmpeg reads). `parse_voice_request` runs on the stub's execute thread and again in
the worker (the two ends trust nothing they did not check): each problem is `InvalidInput` naming
the input (the gateway turns NAME, TRANSCRIPT, AUDIO into its form's `name`, `transcript`, `file`).
Decoding the audio is the registrar's, off every execute thread (`registrar.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tandem.backend.errors import InvalidInput
from tandem.backend.settings import VoiceSettings
from tandem.backend.voices.store import check_name
from tandem.wire import contract as wire

ACTION, NAME, TRANSCRIPT, AUDIO = (t.name for t in (wire.ACTION, wire.NAME, wire.TRANSCRIPT, wire.REFERENCE))
INPUTS = (ACTION, NAME, TRANSCRIPT, AUDIO)
RESULT = wire.RESULT.name  # the one output: the answer as JSON


class Action(StrEnum):
    REGISTER = "register"
    LIST = "list"
    DELETE = "delete"


@dataclass(frozen=True)
class VoiceRequest:
    action: Action
    name: str = ""
    transcript: str = ""
    audio: bytes = b""


def _text(raw: bytes | None, name: str) -> str | None:
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"{name} is not valid UTF-8") from None


def parse_voice_request(
    inputs: Mapping[str, bytes | None], settings: VoiceSettings, builtin: Sequence[str]
) -> VoiceRequest:
    """The request in `inputs` (each input's bytes, None when absent). Raises InvalidInput: no or
    an unknown ACTION; a missing or malformed NAME; a built-in NAME to register or delete; an
    empty, missing or too long TRANSCRIPT; a missing, empty or too large AUDIO."""
    action_text = _text(inputs.get(ACTION), ACTION)
    if not action_text:
        raise InvalidInput(f"ACTION is required: one of {', '.join(a.value for a in Action)}")
    try:
        action = Action(action_text)
    except ValueError:
        raise InvalidInput(
            f"ACTION {action_text[:40]!r} is not one of {', '.join(a.value for a in Action)}"
        ) from None
    if action is Action.LIST:
        return VoiceRequest(action)
    name = _text(inputs.get(NAME), NAME)
    if name is None:
        raise InvalidInput(f"NAME is required to {action.value} a voice")
    check_name(name)
    # Case-insensitively: `TARA` beside the built-in `tara` would be two voices a listing and a
    # caller's eye cannot tell apart.
    if name.rpartition(".")[2].casefold() in {b.casefold() for b in builtin}:
        verb = "registered" if action is Action.REGISTER else "deleted"
        raise InvalidInput(f"NAME {name!r} is a built-in voice of this model; it cannot be {verb}")
    if action is Action.DELETE:
        return VoiceRequest(action, name)
    raw = inputs.get(TRANSCRIPT)
    if raw is not None and len(raw) > settings.max_transcript_bytes:
        raise InvalidInput(f"TRANSCRIPT is {len(raw)} bytes; the limit is {settings.max_transcript_bytes}")
    transcript = (_text(raw, TRANSCRIPT) or "").strip()
    if not transcript:
        raise InvalidInput("TRANSCRIPT is required: what the reference recording says")
    audio = inputs.get(AUDIO)
    if audio is None:
        raise InvalidInput("AUDIO is required: the reference recording's file")
    if len(audio) > settings.max_file_bytes:
        raise InvalidInput(f"AUDIO is {len(audio)} bytes; the limit is {settings.max_file_bytes}")
    return VoiceRequest(action, name, transcript, audio)
