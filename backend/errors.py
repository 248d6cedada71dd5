"""Errors the engines raise, each with the client-facing status it maps to.

Engines know nothing of Triton; `model_repository/*/model.py` turns `code` into a `TritonError`
code. gRPC streams drop the status code (docs/protocol.md: only the message reaches the client), so
`str(err)` starts with the code name in brackets and clients can still tell the kinds apart.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    INVALID_ARG = "INVALID_ARG"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    CANCELLED = "CANCELLED"
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a registered voice's name is taken
    NOT_FOUND = "NOT_FOUND"  # no registered voice of that name


class TandemError(Exception):
    """Base of every error an engine reports to a client."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(f"[{self.code.value}] {message}")
        self.detail = message


class InvalidInput(TandemError):
    """The request is malformed; nothing was allocated for it."""

    code = ErrorCode.INVALID_ARG


class Overloaded(TandemError):
    """No capacity within the bounded admission wait; the client may retry elsewhere."""

    code = ErrorCode.UNAVAILABLE


class StreamFailed(TandemError):
    """A stream ended early on the server side (failed transfer, engine fault)."""

    code = ErrorCode.INTERNAL


class Cancelled(TandemError):
    code = ErrorCode.CANCELLED


class AlreadyExists(TandemError):
    """The name is taken (a registered voice); nothing was changed."""

    code = ErrorCode.ALREADY_EXISTS


class NotFound(TandemError):
    """No such thing to act on (a registered voice to delete)."""

    code = ErrorCode.NOT_FOUND


class PoolExhausted(Exception):
    """Internal: a KV pool has fewer free pages than asked for (admission maps it to a wait)."""
