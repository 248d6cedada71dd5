"""The unit secret and the mutual handshake of the unit's TCP endpoints.

Two TCP listeners exist: D's data listener (the `tcp` path, `transfer/paths/tcp.py`) and, when the
control plane runs over TCP (cross-host, `TransferSender(control="tcp")`), P's control listener. A
unix socket is guarded by its 0700 directory and the peer's uid; a TCP port is not, so both sides
prove they hold the unit's 32-byte secret before anything else crosses:

    listener  -> connector   magic[4] + nonce_l[32]
    connector -> listener    HMAC-SHA256(secret, role_c + nonce_l + nonce_c)[32] + nonce_c[32]
    listener  -> connector   HMAC-SHA256(secret, role_l + nonce_c + nonce_l)[32]

Mutual: the connector never talks to an impostor listener either. Fresh nonces on both sides, so a
recorded handshake cannot be replayed. The magic names the listener's kind, so a connector that
reached the wrong port fails at once. The secret lives in `<control_dir(unit)>/tcp.secret` (0600 in
the unit's 0700 directory, created by whichever side needs it first) or, across hosts, in a file both
hosts mount (`tandem.transfer.secret_file`, e.g. a Kubernetes Secret).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from pathlib import Path

from .errors import TransferError

SECRET_NAME = "tcp.secret"
SECRET_BYTES = 32
HANDSHAKE_TIMEOUT_S = 2.0  # the whole handshake, not each read: a trickling peer cannot stretch it


class AuthFailed(TransferError):
    """The peer did not prove it holds the unit secret (or is not a tandem endpoint of that kind)."""


def unit_secret(directory: Path) -> bytes:
    """The unit's shared secret, created (0600, atomically) if missing. Called by both sides."""
    path = directory / SECRET_NAME
    try:
        return read_secret(path)
    except FileNotFoundError:
        pass
    tmp = directory / f".{SECRET_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(SECRET_BYTES))
    finally:
        os.close(fd)
    with contextlib.suppress(FileExistsError):
        os.link(tmp, path)  # atomic: the first creator wins, everyone reads the winner's bytes
    tmp.unlink()
    return read_secret(path)


def read_secret(path: Path) -> bytes:
    """A secret file's bytes; raises FileNotFoundError, or TransferError if it has the wrong size."""
    data = path.read_bytes()
    if len(data) != SECRET_BYTES:
        raise TransferError(f"{path} holds {len(data)} bytes, expected a {SECRET_BYTES}-byte unit secret")
    return data


def mac(secret: bytes, role: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, role + a + b, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes, or EOFError; with `deadline` (time.monotonic()) a TimeoutError once it passes,
    however the peer trickles its bytes."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"peer sent {got} of {n} bytes before the deadline")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("peer closed the connection")
        got += k
    return bytes(buf)


def accept_handshake(
    sock: socket.socket, secret: bytes, magic: bytes, roles: tuple[bytes, bytes] = (b"l", b"c")
) -> None:
    """Listener side, on a freshly accepted socket. `roles` = (listener's, connector's) MAC role.
    Raises `AuthFailed` (or OSError/EOFError on a broken connection); leaves the timeout as it was."""
    role_l, role_c = roles
    old = sock.gettimeout()
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        nonce_l = secrets.token_bytes(32)
        sock.sendall(magic + nonce_l)
        reply = recv_exact(sock, 64, deadline)
        their_mac, nonce_c = reply[:32], reply[32:]
        if not hmac.compare_digest(their_mac, mac(secret, role_c, nonce_l, nonce_c)):
            raise AuthFailed("the connecting peer does not hold the unit secret")
        sock.sendall(mac(secret, role_l, nonce_c, nonce_l))
    finally:
        sock.settimeout(old)


def connect_handshake(
    sock: socket.socket,
    secret: bytes,
    magic: bytes,
    roles: tuple[bytes, bytes] = (b"l", b"c"),
    what: str = "tandem endpoint",
) -> None:
    """Connector side, right after connect. Raises `AuthFailed` naming `what` it expected."""
    role_l, role_c = roles
    old = sock.gettimeout()
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        hello = recv_exact(sock, len(magic) + 32, deadline)
        if hello[: len(magic)] != magic:
            raise AuthFailed(f"not a {what}")
        nonce_l, nonce_c = hello[len(magic) :], secrets.token_bytes(32)
        sock.sendall(mac(secret, role_c, nonce_l, nonce_c) + nonce_c)
        try:
            proof = recv_exact(sock, 32, deadline)
        except EOFError:
            raise AuthFailed(
                f"the {what} hung up after our proof: it holds another unit secret than ours"
            ) from None
        if not hmac.compare_digest(proof, mac(secret, role_l, nonce_c, nonce_l)):
            raise AuthFailed(f"the {what} does not hold the unit secret")
    finally:
        sock.settimeout(old)


def sign_ticket(secret: bytes, ticket_json_without_mac: bytes) -> str:
    """P's signature over a ticket (hex): D follows a tcp:// endpoint only in a ticket this unit's P
    signed, so a forged HANDOFF cannot make D connect to, and prove itself to, an arbitrary host."""
    return hmac.new(secret, b"ticket" + ticket_json_without_mac, hashlib.sha256).hexdigest()


def ticket_signed(secret: bytes, ticket_json_without_mac: bytes, mac_hex: str) -> bool:
    if len(mac_hex) != 64 or any(c not in "0123456789abcdef" for c in mac_hex):
        return False
    return hmac.compare_digest(sign_ticket(secret, ticket_json_without_mac), mac_hex)
