"""What one request may carry: a body no larger than its route's limit, text that is UTF-8.

Body size: FastAPI's `max_body_size` (the app's default, `SPEECH_BODY_BYTES`; a route's own, e.g.
`POST /v1/voices`'s `voices.UPLOAD_CEILING`) counts the bytes as the app reads them, so a chunked
body is cut at the limit (413, `http_errors.install` answers it). Its Content-Length check runs
only when the app first reads the body (after the handler's own awaits) and answers plain text, so
`ContentLengthLimit` checks a declared Content-Length against the same route limit before the app
runs at all and answers 413 in OpenAI's JSON, leaving the body unread; the HTTP server then
discards what still arrives for at most its drain time (`gateway/serve.py`). Nothing here buffers
a body.

Text: JSON may carry a lone surrogate (`"\\udfff"`), which Python's `json` and pydantic accept as a
`str` that cannot be encoded; `Utf8Str` refuses it in validation (400 naming the field) instead of
a 500 where the text is encoded.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated

from pydantic import AfterValidator
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.gateway.http_errors import error_body

SPEECH_BODY_BYTES = 64 * 1024  # a speech body: `input` is <= 4,096 characters, 6 bytes each escaped


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode: a lone surrogate at position {exc.start}") from None
    return value


Utf8Str = Annotated[str, AfterValidator(_utf8)]


class ContentLengthLimit:
    """ASGI middleware: a request whose Content-Length is over its route's `max_body_size` (else the
    app's) is answered 413 before the app sees it; `count(413)` is called for each."""

    def __init__(self, app: ASGIApp, limit_of: Callable[[Scope], int | None], count: Callable[[int], None]):
        self.app = app
        self.limit_of = limit_of
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            declared = _content_length(scope)
            limit = self.limit_of(scope) if declared is not None else None
            if declared is not None and limit is not None and declared > limit:
                self.count(413)
                msg = f"the request body is {declared} bytes; this route takes at most {limit}"
                body = json.dumps(error_body(413, msg)).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send({"type": "http.response.start", "status": 413, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def route_limit(routes: list[object], default: int | None) -> Callable[[Scope], int | None]:
    """The body limit of the route `scope` goes to: its `max_body_size`, else `default`."""

    def limit_of(scope: Scope) -> int | None:
        own = _route_limit(routes, scope)
        return own if own is not None else default

    return limit_of


def _route_limit(routes: list[object], scope: Scope) -> int | None:
    for route in routes:
        matches = getattr(route, "matches", None)
        if matches is None or matches(scope)[0] != Match.FULL:
            continue
        # A router added with include_router (gateway/voices.py) is matched as a whole: look inside.
        inner = getattr(getattr(route, "original_router", None), "routes", None)
        return _route_limit(inner, scope) if inner is not None else getattr(route, "max_body_size", None)
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
