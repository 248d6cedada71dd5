"""Behind a router: the per-client cap keyed on the client the router forwards, never on the router.

Behind Envoy every connection comes from the router's address, so a cap per peer address
(`ServerLimits.max_per_client`) would cap all traffic at 512. With `tandem-gateway
--trusted-proxies ADDRS` (IPs or CIDRs, comma-separated; `ServerLimits.trusted_proxies`):

- uvicorn's own `ProxyHeadersMiddleware` (`proxy_headers`, `forwarded_allow_ips`) rewrites a
  request's client to the one `X-Forwarded-For` names, and only for a connection whose peer is a
  trusted proxy (the rightmost address in the header that is not itself trusted); from any other
  peer the header is ignored, so a client cannot forge its way past its cap.
- A connection from a trusted proxy is admitted under the total cap only (`ConnectionGuard.admit`):
  it carries many clients' requests.
- `ClientCap` caps the requests and WebSockets in flight per client as rewritten: past
  `max_per_client` one is answered 503 (OpenAI's JSON, `Retry-After: 1`; a WebSocket is closed
  1013, try again later) and counted as `client_cap`. For a direct client this never bites before
  the connection cap does (HTTP/1.1 carries one request at a time), so the cap means the same for
  both.

Without trusted proxies nothing here runs: the headers are ignored and the cap is the peer's.
"""

from __future__ import annotations

import collections
import ipaddress
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tandem.gateway.connection_guard import ConnectionGuard
from tandem.gateway.http_errors import error_body


def parse_trusted(spec: str) -> tuple[str, ...]:
    """`--trusted-proxies`: IPs or CIDRs, comma-separated; ValueError naming a bad one."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            ipaddress.ip_network(part, strict=False)
        except ValueError:
            raise ValueError(f"--trusted-proxies: {part!r} is not an IP address or CIDR") from None
        out.append(part)
    return tuple(out)


class Trusted:
    """Whether a peer address is one of the trusted proxies."""

    def __init__(self, proxies: Sequence[str]) -> None:
        self.networks = [ipaddress.ip_network(p, strict=False) for p in proxies]

    def __contains__(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in n for n in self.networks)


class ClientCap:
    """ASGI: at most `guard.limits.max_per_client` requests and WebSockets in flight per client
    address as the app sees it (`scope["client"]`, after a trusted proxy's X-Forwarded-For)."""

    def __init__(self, app: ASGIApp, guard: ConnectionGuard) -> None:
        self.app = app
        self.guard = guard
        self.in_flight: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        host = str(client[0]) if client else "?"
        cap = self.guard.limits.max_per_client
        if self.in_flight[host] >= cap:
            why = f"{host} has {self.in_flight[host]} requests in flight, the cap per client is {cap}"
            self.guard.cut("client_cap", host, why)
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1013, "reason": "over the cap per client"})
                return
            body = error_body(503, f"the gateway is at its cap per client: {why}")
            await JSONResponse(body, 503, {"Retry-After": "1"})(scope, receive, send)
            return
        self.in_flight[host] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[host] -= 1
            if self.in_flight[host] <= 0:
                del self.in_flight[host]
