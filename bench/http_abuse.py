"""Hostile HTTP clients on raw sockets, and what they measure (`bench/gateway_abuse.py`, and
`tests/process/test_gateway_abuse.py` at a CI scale).

- `first_byte`: a bystander's request, connect to the response's first byte.
- `IdleHolder`: one client (one source address, a subprocess of its own) that opens N connections,
  sends each a partial request head and then a byte a second (slowloris), and reports what the
  server did to them.
- `big_bodies`: N concurrent requests declaring (or chunking) a huge body, sent while reading,
  each stopped at its answer: status, time to the first response byte, bytes sent by then.
- `RssSampler`: a process's peak RSS over a window, sampled from /proc.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

HEAD = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Slow: "  # never finished: then "a" a second


def _connect(host: str, port: int, src: str, timeout_s: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.settimeout(timeout_s)
    s.connect((host, port))
    return s


def first_byte(host: str, port: int, path: str = "/v1/models", src: str = "127.0.0.1") -> tuple[float, int]:
    """(seconds from connect to the first response byte, HTTP status) of one GET."""
    t0 = time.perf_counter()
    with _connect(host, port, src) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n".encode())
        first = s.recv(1)
        elapsed = time.perf_counter() - t0
        data = first
        while len(data) < 12:
            more = s.recv(64)
            if not more:
                break
            data += more
    return elapsed, parse_status(data)


def parse_status(data: bytes) -> int:
    return int(data[9:12]) if data.startswith(b"HTTP/1.") and len(data) >= 12 else 0


@dataclass
class HoldReport:
    wanted: int
    opened: int  # connect() succeeded
    connect_failed: int
    open_s: float  # time to open them all
    refused_503: int  # answered 503 (the cap) at once
    answered: dict[str, int]  # every status seen, by status
    closed_silently: int  # closed without an answer
    still_open: int  # at the end of the hold


def _hold(host: str, port: int, n: int, src: str, hold_s: float) -> None:
    """The holder's process: prints "ready" once every connection was tried, then the report (JSON)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = n + 64
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(want, soft), max(want, hard)))
        except (ValueError, OSError):  # not root: as many as the hard limit allows
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks: list[socket.socket] = []
    failed = 0
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            s = _connect(host, port, src)
            s.setblocking(False)
            s.send(HEAD)
            socks.append(s)
        except OSError:
            failed += 1
    open_s = time.perf_counter() - t0
    print("ready", flush=True)
    answered: dict[str, int] = {}
    got: dict[int, bytes] = {}
    closed = 0
    alive = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in alive:
        poller.register(fd, select.POLLIN)
    end = time.monotonic() + hold_s
    next_trickle = time.monotonic() + 1.0
    while alive and time.monotonic() < end:
        for fd, _ in poller.poll(100):
            conn = alive.get(fd)
            if conn is None:
                continue
            try:
                data = conn.recv(4096)
            except OSError:
                data = b""
            if data:
                got[fd] = got.get(fd, b"") + data
                continue
            status = parse_status(got.get(fd, b""))
            if status:
                answered[str(status)] = answered.get(str(status), 0) + 1
            else:
                closed += 1
            poller.unregister(fd)
            del alive[fd]
            conn.close()
        if time.monotonic() >= next_trickle:  # a byte a second on each connection still open
            next_trickle += 1.0
            for s in list(alive.values()):
                with contextlib.suppress(OSError):
                    s.send(b"a")
    for fd in list(alive):  # answered but not closed yet count as answered
        status = parse_status(got.get(fd, b""))
        if status:
            answered[str(status)] = answered.get(str(status), 0) + 1
    report = HoldReport(
        wanted=n,
        opened=len(socks),
        connect_failed=failed,
        open_s=open_s,
        refused_503=answered.get("503", 0),
        answered=answered,
        closed_silently=closed,
        still_open=sum(1 for fd in alive if not parse_status(got.get(fd, b""))),
    )
    for s in alive.values():
        s.close()
    print(json.dumps(asdict(report)), flush=True)


class IdleHolder:
    """`n` slowloris connections from `src` for `hold_s`, in a process of its own (one client)."""

    def __init__(self, host: str, port: int, n: int, src: str = "127.0.0.2", hold_s: float = 10.0) -> None:
        self.cmd = [
            sys.executable,
            "-m",
            "tandem.bench.http_abuse",
            host,
            str(port),
            str(n),
            src,
            str(hold_s),
        ]
        self.hold_s = hold_s
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> IdleHolder:
        self._proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Returns once every connection was tried."""
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.kill()
            raise RuntimeError(f"the idle holder did not open its connections within {timeout_s} s: {line!r}")

    @property
    def ready(self) -> bool:
        """Whether "ready" can be read now (then `wait_ready` returns at once)."""
        assert self._proc is not None and self._proc.stdout is not None
        return bool(select.select([self._proc.stdout], [], [], 0)[0])

    def report(self) -> HoldReport:
        """Waits for the hold to end."""
        assert self._proc is not None and self._proc.stdout is not None
        self._proc.wait(timeout=self.hold_s + 120)
        # read() and not communicate(): wait_ready's readline may hold the report in its buffer
        # already (a hold that ended at once), which communicate's raw reads would miss.
        out = self._proc.stdout.read()
        return HoldReport(**json.loads(out.strip().splitlines()[-1]))

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)


@dataclass
class BodyResult:
    status: int
    first_byte_s: float  # from the first byte sent to the response's first byte
    sent_bytes: int  # body bytes sent by then
    message: str


def _one_body(
    host: str, port: int, path: str, size: int, chunked: bool, content_type: str, out: list[BodyResult]
) -> None:
    s = _connect(host, port, "127.0.0.1")
    head = f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: {content_type}\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {size}\r\n\r\n"
    piece = b"x" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n" if chunked else piece
    t0 = time.perf_counter()
    s.sendall(head.encode())
    s.setblocking(False)
    sent, got, first = 0, b"", 0.0
    pending = memoryview(b"")
    while True:
        readable, writable, _ = select.select([s], [s] if sent < size else [], [], 5.0)
        if readable:
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if data and not got:
                first = time.perf_counter() - t0
            got += data
            if not data or _complete(got):
                break
        elif not writable and not readable:
            break  # 5 s with nothing either way
        if writable:
            if not pending:
                pending = memoryview(frame)
            try:
                n = s.send(pending)
            except OSError:
                break
            pending = pending[n:]
            sent += n
    s.close()
    body = got.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in got else b""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    out.append(BodyResult(parse_status(got), first, sent, message))


def _complete(data: bytes) -> bool:
    if b"\r\n\r\n" not in data:
        return False
    head, body = data.split(b"\r\n\r\n", 1)
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    return False


def big_bodies(
    host: str,
    port: int,
    path: str = "/v1/audio/speech",
    n: int = 8,
    size: int = 100 * 10**6,
    chunked: bool = False,
    content_type: str = "application/json",
) -> list[BodyResult]:
    """`n` concurrent requests of a `size`-byte body, each stopped at its answer."""
    out: list[BodyResult] = []
    threads = [
        threading.Thread(target=_one_body, args=(host, port, path, size, chunked, content_type, out))
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def websocket_flood(
    host: str, port: int, n: int, src: str, path: str
) -> tuple[list[socket.socket], dict[int, int]]:
    """Open `n` connections from `src` and ask each to upgrade to a WebSocket on `path`; returns the
    sockets still open (the upgraded ones, held by the caller) and the count of each status."""
    held: list[socket.socket] = []
    statuses: dict[int, int] = {}
    for _ in range(n):
        try:
            s = _connect(host, port, src)
        except OSError:
            statuses[0] = statuses.get(0, 0) + 1
            continue
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(
            f"GET {path} HTTP/1.1\r\nHost: gateway\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        try:
            status = parse_status(s.recv(64))
        except OSError:
            status = 0
        statuses[status] = statuses.get(status, 0) + 1
        if status == 101:
            held.append(s)
        else:
            s.close()
    return held, statuses


class RssSampler:
    """The peak RSS of `pid` while the `with` block runs (sampled every `every_s`)."""

    def __init__(self, pid: int, every_s: float = 0.005) -> None:
        self.pid = pid
        self.every_s = every_s
        self.before = rss_bytes(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(self.every_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.before


if __name__ == "__main__":  # the idle holder's process: HOST PORT N SRC HOLD_S
    _hold(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
