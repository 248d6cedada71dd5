"""What an error a `tts`/`tts_mono` client receives means: one code, read the same way by every client.

Where a client can read the code (Triton 2.51, gRPC streaming, tested in tests/integration):

- tandem's own errors (the engines, `serving/triton_io.py`): the message starts with the code in
  brackets, `[INVALID_ARG] MAX_TOKENS = 0 is outside [1, 2048]`. Through the `tts` ensemble Triton puts
  `in ensemble 'tts', ` in front of it (and may put `[request id: N] `), so the code is the first
  `[CODE]` after those prefixes.
- Triton core's own errors (a request Triton refuses before any tandem code runs: wrong dtype or
  shape, an input the model does not have, a required input missing, no correlation id, an unknown
  model) carry no code: an in-stream error is only a message (gRPC streaming has no status per
  response). `classify` maps the known messages; an unknown message without a code is INTERNAL.
- Errors of the gRPC stream itself (server down, deadline, a cancelled call) carry a gRPC status
  code (tritonclient's `InferenceServerException.status()`, e.g. `StatusCode.UNAVAILABLE`); that
  status decides, mapped by `_GRPC`.

`tandem.gateway.client` and the HTTP gateway (`gateway/app.py`, HTTP status by `HTTP_STATUS`)
both use `classify`. Nothing here imports Triton.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class ClientCode(str, Enum):
    """The codes a client can see: tandem's (`backend.errors.ErrorCode`), NOT_FOUND also Triton's."""

    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a registered voice's name is taken (`backend.errors`)


HTTP_STATUS = {
    ClientCode.INVALID_ARG: 400,
    ClientCode.NOT_FOUND: 404,
    ClientCode.ALREADY_EXISTS: 409,
    ClientCode.CANCELLED: 499,
    ClientCode.INTERNAL: 500,
    ClientCode.UNAVAILABLE: 503,
}

# What Triton puts in front of a message: the ensemble that ran the step, the request's id.
_PREFIX = re.compile(r"^(?:in ensemble '[^']*', |\[request id: [^\]]*\] )+")
_CODE = re.compile(r"^\[(" + "|".join(c.value for c in ClientCode) + r")\] ?")

# Triton core's messages (2.51, src/core and the gRPC frontend), matched anywhere in the message.
_CORE: tuple[tuple[re.Pattern[str], ClientCode], ...] = (
    (re.compile(r"must specify a non-zero or non-empty correlation ID"), ClientCode.INVALID_ARG),
    (re.compile(r"unexpected datatype|inference input '[^']*' data-type is"), ClientCode.INVALID_ARG),
    (
        re.compile(
            r"unexpected shape for input|unexpected number of dims|Shape does not match"
            r"|input byte size mismatch|All input dimensions should be specified"
        ),
        ClientCode.INVALID_ARG,
    ),
    (
        re.compile(r"unexpected inference input|expected \d+ inputs but got|missing required input"),
        ClientCode.INVALID_ARG,
    ),
    (re.compile(r"unexpected explicit tensor data|unable to parse|Unable to parse"), ClientCode.INVALID_ARG),
    (re.compile(r"Request for unknown model|is not found|unknown model"), ClientCode.NOT_FOUND),
    (
        re.compile(r"is not ready|is not healthy|Server is stopping|exceeds maximum queue size", re.I),
        ClientCode.UNAVAILABLE,
    ),
)

_GRPC = {
    "StatusCode.INVALID_ARGUMENT": ClientCode.INVALID_ARG,
    "StatusCode.NOT_FOUND": ClientCode.NOT_FOUND,
    "StatusCode.UNAVAILABLE": ClientCode.UNAVAILABLE,
    "StatusCode.DEADLINE_EXCEEDED": ClientCode.UNAVAILABLE,
    "StatusCode.RESOURCE_EXHAUSTED": ClientCode.UNAVAILABLE,
    "StatusCode.CANCELLED": ClientCode.CANCELLED,
}


@dataclass(frozen=True)
class ClientError:
    """One error as a client sees it: its code and the message without Triton's ensemble prefix or
    the bracketed code (`str()` gives `[CODE] detail`, the form tandem's own messages have)."""

    code: ClientCode
    detail: str

    def __str__(self) -> str:
        return f"[{self.code.value}] {self.detail}"


def classify(message: str, grpc_status: str | None = None) -> ClientError:
    """The code of an error a client received: `message` as received, `grpc_status` the stream's gRPC
    status (`str(StatusCode.X)`) when the error came from the stream itself rather than a response."""
    text = _PREFIX.sub("", message.strip())
    m = _CODE.match(text)
    if m:
        return ClientError(ClientCode(m.group(1)), text[m.end() :])
    if grpc_status in _GRPC:
        return ClientError(_GRPC[grpc_status], text)
    for pattern, code in _CORE:
        if pattern.search(text):
            return ClientError(code, text)
    return ClientError(ClientCode.INTERNAL, text)
