"""The stream-input WebSocket's client frames: one pydantic model per `type`, and `parse_frame`, the
one place a client's text becomes a frame or a `FrameError` naming what is wrong (docs/protocol.md,
"Streamed text input", is the contract; `gateway/ws.py` acts on the frames).

Bounds checked before any JSON is parsed: a frame is at most `MAX_FRAME_CHARS` characters and
`MAX_DEPTH` levels of nesting (a 100k-deep frame would end the parser in a RecursionError). An error
quotes at most `QUOTE_CHARS` characters of a client's value.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_FRAME_CHARS = 64 * 1024  # a text frame carries at most ws_max_pending_chars (8,192), escaped
MAX_DEPTH = 2  # every frame is a flat object; one level of slack for a value a client wraps
QUOTE_CHARS = 40  # the most of a client's value an error quotes
SPEED_MIN, SPEED_MAX = 0.25, 4.0  # as over HTTP (FFmpeg's atempo)
INACTIVITY_MIN_S, INACTIVITY_MAX_S = 1.0, 600.0  # a socket's idle limit, as `config` may set it
CONTEXT_ID_CHARS = 64
TYPES = "config, text, flush, cancel, close_context, keepalive, close"
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")

# A context's name: what a client may choose (letters, digits, `_.:-`), so it is safe to echo.
ContextId = Annotated[str, Field(min_length=1, max_length=CONTEXT_ID_CHARS, pattern=r"^[A-Za-z0-9_.:\-]+$")]
Speed = Annotated[float, Field(ge=SPEED_MIN, le=SPEED_MAX)]


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigFrame(_Frame):
    """First and once: what every context of the socket speaks with."""

    type: Literal["config"]
    model: str
    voice: str
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "pcm"
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    speed: Speed = 1.0  # a turn's, unless its opening `text` says otherwise
    inactivity_timeout: float | None = Field(None, ge=INACTIVITY_MIN_S, le=INACTIVITY_MAX_S)
    audio: Literal["binary", "json"] = "binary"  # binary frames, or `audio` events (base64, segment times)


class TextFrame(_Frame):
    type: Literal["text"]
    text: str
    context_id: ContextId | None = None
    speed: Speed | None = None  # the turn this text opens speaks at it


class FlushFrame(_Frame):
    type: Literal["flush"]
    context_id: ContextId | None = None


class CancelFrame(_Frame):
    type: Literal["cancel"]
    context_id: ContextId | None = None


class CloseContextFrame(_Frame):
    type: Literal["close_context"]
    context_id: ContextId | None = None


class KeepaliveFrame(_Frame):
    type: Literal["keepalive"]


class CloseFrame(_Frame):
    type: Literal["close"]


ClientFrame = Annotated[
    ConfigFrame | TextFrame | FlushFrame | CancelFrame | CloseContextFrame | KeepaliveFrame | CloseFrame,
    Field(discriminator="type"),
]
ContextFrame = TextFrame | FlushFrame | CancelFrame | CloseContextFrame  # what a context acts on
_FRAME: TypeAdapter[Any] = TypeAdapter(ClientFrame)


class FrameError(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def cut(text: str) -> str:
    """`text` as an error may quote it: at most `QUOTE_CHARS` characters of it."""
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def quote(value: object) -> str:
    return cut(repr(value))


def _depth(raw: str) -> int:
    """How deep `raw`'s arrays and objects nest (strings skipped); linear in its length."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", raw)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_frame(raw: str) -> Any:
    """One client frame; raises FrameError naming what is wrong (`param`: the field)."""
    if len(raw) > MAX_FRAME_CHARS:
        raise FrameError(f"frame is {len(raw)} characters; the limit is {MAX_FRAME_CHARS}", None)
    if (depth := _depth(raw)) > MAX_DEPTH:
        raise FrameError(f"frame nests {depth} levels of JSON; the limit is {MAX_DEPTH}", None)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}", None) from None
    if not isinstance(data, dict):
        raise FrameError(f"frame is a JSON {type(data).__name__}, not an object with a type", None)
    if "type" not in data:
        raise FrameError(f"frame has no type (one of {TYPES})", "type")
    try:
        return _FRAME.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if loc and loc[0] == data.get("type"):  # the union's tag leads the location
            loc = loc[1:]
        if first.get("type") == "union_tag_invalid":
            raise FrameError(f"type {quote(data['type'])} is not one of {TYPES}", "type") from None
        param = loc[0] if loc else None
        kind, where = cut(str(data.get("type"))), cut(".".join(loc) or "frame")
        raise FrameError(f"{kind} frame: {where}: {first.get('msg')}", param and cut(param)) from None
