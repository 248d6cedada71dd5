"""API keys and tenants: who is calling, from `Authorization: Bearer KEY` as the OpenAI SDK sends it.

`tandem-gateway --api-keys FILE` (or `TANDEM_API_KEYS=FILE`) turns keys on. The file holds one key a
line, `TENANT KEY` (whitespace between; blank lines and `#` comments skipped); a tenant is
`[A-Za-z0-9_-]{1,32}` and may hold several keys (rotation), a key belongs to one tenant. With keys,
speech and the voice routes need a key: a request without one or with an unknown one is 401 in
OpenAI's error shape (`code` `invalid_api_key`, `WWW-Authenticate: Bearer`). `/health`, `/metrics`
and `/v1/models` stay open (probes and scrapers carry no key; the model list is the same for
everyone). The WebSocket takes the same header at its handshake (`ws_caller`); refused, the
handshake is answered 401 with the same JSON (where the server cannot send a body, it is closed
with 1008, policy violation) and no socket opens.

Without keys the gateway is in open development mode: it says so at start (a WARNING line), every
caller is the one tenant `OPEN`, and nothing is refused for want of a key.

A tenant owns the voices it registers: the gateway names them on the unit `TENANT.NAME` (the
store's namespaced name, `backend/voices/store.py`), lists, speaks and deletes only the caller's
own, and its unknown-voice error names only the built-in voices and the caller's.
"""

from __future__ import annotations

import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request, WebSocket
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tandem.gateway.http_errors import error_body

log = logging.getLogger("tandem.gateway")

TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,32}")
OPEN = ""  # the tenant of an open (keyless) gateway: its voices are the store's plain names
ENV = "TANDEM_API_KEYS"


class Unauthorized(Exception):
    """No key, or one this gateway does not know: 401 (`gateway/app.py` answers it)."""


@dataclass(frozen=True)
class ApiKeys:
    """Key -> tenant; empty: open development mode."""

    tenants: dict[str, str]

    @property
    def open(self) -> bool:
        return not self.tenants

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        """The keys of `path` (module docstring); ValueError naming the line otherwise."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"api keys file {path}: {exc.strerror or exc}") from None
        tenants: dict[str, str] = {}
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or not TENANT_PATTERN.fullmatch(parts[0]) or len(parts[1]) < 16:
                raise ValueError(
                    f"api keys file {path}, line {n}: expected `TENANT KEY` (a tenant of 1-32 of A-Z, a-z, "
                    "0-9, '_', '-'; a key of at least 16 characters)"
                )
            tenant, key = parts
            if tenants.setdefault(key, tenant) != tenant:
                raise ValueError(f"api keys file {path}, line {n}: the key is already another tenant's")
        if not tenants:
            raise ValueError(f"api keys file {path}: no keys (leave --api-keys out for open mode)")
        return cls(tenants)

    def tenant(self, key: str | None) -> str:
        """The tenant of `key`; Unauthorized without one or for an unknown one. Every key is compared
        in constant time, so the time taken does not tell how much of a guess matched."""
        if self.open:
            return OPEN
        if not key:
            raise Unauthorized("no API key: send it as `Authorization: Bearer KEY`")
        found = None
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                found = tenant
        if found is None:
            raise Unauthorized("the API key is not valid here")
        return found


def voice_id(tenant: str, name: str) -> str:
    """`name` as the unit stores it for `tenant`."""
    return f"{tenant}.{name}" if tenant else name


def own_name(tenant: str, stored: str) -> str | None:
    """The caller's name for the stored voice `stored`, or None when it is not `tenant`'s."""
    space, dot, name = stored.rpartition(".")
    if tenant:
        return name if dot and space == tenant else None
    return None if dot else stored


_bearer = HTTPBearer(auto_error=False)


async def caller(
    request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    """The FastAPI dependency of every keyed route: the caller's tenant."""
    keys: ApiKeys = request.app.state.api_keys
    return keys.tenant(creds.credentials if creds is not None else None)


async def ws_caller(ws: WebSocket) -> str | None:
    """The tenant of a WebSocket handshake (`Authorization: Bearer KEY`); None when it was refused
    (answered here: 401 in OpenAI's shape, or close 1008 where the server sends no denial body)."""
    keys: ApiKeys = ws.app.state.api_keys
    header = ws.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    try:
        return keys.tenant(key.strip() if scheme.lower() == "bearer" else None)
    except Unauthorized as exc:
        if "websocket.http.response" in ws.scope.get("extensions", {}):
            body = error_body(401, str(exc), None, "invalid_api_key")
            await ws.send_denial_response(JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"}))
        else:
            await ws.close(code=1008, reason=str(exc))
        return None


Tenant = Annotated[str, Depends(caller)]  # a route's parameter: the caller's tenant (401 without a key)
