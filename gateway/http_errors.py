"""Every error the gateway answers is OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`.

`code` is the tandem code (`gateway/errors.py`) where one applies, else the one its HTTP status has
(`CODE_BY_STATUS`); `type` is `invalid_request_error` below 500, `server_error` from 500. Besides the
gateway's own refusals (`app.error_response`; FastAPI's 422, a body that fails validation, is
400 there), `install` answers this way for what FastAPI and
Starlette would answer themselves (404 no such route, 405, 400 a body that does not parse (also
JSON nested past Python's recursion limit), 413 a body over its route's limit, 500 an exception
nobody caught), and `raw_response` gives the bytes the HTTP server writes itself, outside the app
(`gateway/serve.py`: 503 over the connection cap, 408 a read timeout, 400 malformed HTTP).
"""

from __future__ import annotations

import http
import json
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from tandem.gateway.errors import HTTP_STATUS

log = logging.getLogger("tandem.gateway")

CODE_BY_STATUS = {status: code.value for code, status in HTTP_STATUS.items()}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object; `code` defaults to the one `status` has (INVALID_ARG for other 4xx)."""
    if code is None:
        code = CODE_BY_STATUS.get(status, "INVALID_ARG" if status < 500 else "INTERNAL")
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def raw_response(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A whole HTTP/1.1 response with `error_body`, closing the connection: what the server writes
    when no app runs for the request."""
    body = json.dumps(error_body(status, message)).encode()
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *(f"{k}: {v}" for k, v in headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _message(request: Request, exc: HTTPException) -> str:
    if exc.status_code == 404:
        return f"no route {request.url.path}"
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow") or ""
        return f"{request.method} is not allowed on {request.url.path}" + (
            f" (allowed: {allowed})" if allowed else ""
        )
    if exc.status_code == 413:
        limit = request.scope.get("starlette.max_body_size")
        return "the request body is over this route's limit" + (f" of {limit} bytes" if limit else "")
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        return "the body does not parse as JSON (malformed, or nested too deep)"
    return str(exc.detail)


def install(app: FastAPI, count: Callable[[int], None]) -> None:
    """Answer FastAPI's and Starlette's own errors in OpenAI's shape; `count(status)` each (metrics)."""

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        if not isinstance(exc.__cause__, ClientDisconnect):  # gone mid-body: the server counted its cut
            count(exc.status_code)
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        return JSONResponse(error_body(exc.status_code, _message(request, exc)), exc.status_code, headers)

    @app.exception_handler(Exception)
    async def _uncaught(request: Request, exc: Exception) -> JSONResponse:
        count(500)
        log.error("gateway: %s %s failed: %r", request.method, request.url.path, exc, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)
