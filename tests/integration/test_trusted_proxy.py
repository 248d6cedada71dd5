"""The cap per client behind a router, through the real tandem-gateway process (no Triton needed:
`gateway_alone`): from a trusted proxy (`--trusted-proxies`) the cap keys on the client its
`X-Forwarded-For` names, never on the router's own address; from any other peer the header is
ignored, so a forged one does not lift the peer's cap (gateway/forwarded.py)."""

from __future__ import annotations

import json
import socket
from contextlib import ExitStack
from pathlib import Path

from tests.support.gateway_process import GatewayProc, gateway_alone

CAP = 2


def _open(gw: GatewayProc) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    return s


def _answer(s: socket.socket) -> tuple[int, dict]:
    """Read one whole response (the server closes or sends Content-Length): (status, JSON body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ")[1]), json.loads(body) if body else {}


def _get_models(s: socket.socket, forwarded: str) -> tuple[int, dict]:
    s.sendall(f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Forwarded-For: {forwarded}\r\n\r\n".encode())
    return _answer(s)


def _held_post(s: socket.socket, forwarded: str) -> None:
    """A speech request whose body never completes: it stays in flight (until the body timeout)."""
    s.sendall(
        (
            "POST /v1/audio/speech HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"X-Forwarded-For: {forwarded}\r\nContent-Length: 100\r\n\r\n{{"
        ).encode()
    )


def test_a_forged_header_from_an_untrusted_peer_is_ignored(tmp_path: Path) -> None:
    """127.0.0.1 is not the trusted proxy here: its third connection is refused whatever its
    X-Forwarded-For says, and the refusal names the peer's own address."""
    args = [f"--max-connections-per-client={CAP}", "--trusted-proxies=10.9.9.9"]
    with gateway_alone(tmp_path, args) as gw, ExitStack() as stack:
        held = [stack.enter_context(_open(gw)) for _ in range(CAP)]
        assert len(held) == CAP
        extra = stack.enter_context(_open(gw))
        status, body = _get_models(extra, "203.0.113.7")
        assert status == 503, body
        assert "127.0.0.1 holds 2, the cap per client is 2" in body["error"]["message"]


def test_behind_a_trusted_router_the_cap_is_the_forwarded_clients(tmp_path: Path) -> None:
    args = [f"--max-connections-per-client={CAP}", "--trusted-proxies=127.0.0.1"]
    with gateway_alone(tmp_path, args) as gw, ExitStack() as stack:
        # the router's connections past the cap are admitted: each carries its own clients
        router = [stack.enter_context(_open(gw)) for _ in range(CAP + 2)]
        for i, s in enumerate(router[CAP:]):
            assert _get_models(s, f"198.51.100.{i + 1}")[0] == 200
        # one client behind it: CAP requests in flight, the next refused, naming that client
        for s in router[:CAP]:
            _held_post(s, "203.0.113.7")
        extra = stack.enter_context(_open(gw))
        _held_post(extra, "203.0.113.7")
        status, body = _answer(extra)
        assert status == 503, body
        assert "203.0.113.7 has 2 requests in flight, the cap per client is 2" in body["error"]["message"]
        # another client behind the same router is served meanwhile
        assert _get_models(stack.enter_context(_open(gw)), "198.51.100.9")[0] == 200
        assert gw.metric("tandem_gateway_connections_cut_total", reason="client_cap") == 1
