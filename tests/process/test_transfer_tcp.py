"""The TCP path: round trip, the receiver's drop rule (its own proof), authentication, epochs.

The first tests drive the path and D's `TcpArena` directly, doing what the receiver does:
`expect(region, tid)` before the PULL, `forget(region)` before the region is freed or reused. The
last ones run the real `TransferSender` / `TransferReceiver` over it, with P in a thread of this
process and in a spawned child.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.transfer import (
    CopyFailed,
    RegionAllocator,
    RegionState,
    ReleaseReason,
    TransferError,
    TransferReceiver,
    TransferState,
    TransferTimeout,
    WireLayout,
    kv_checksum,
    path_factories,
    select_path,
)
from tandem.transfer.auth import unit_secret
from tandem.transfer.control import control_dir
from tandem.transfer.paths.tcp import MAGIC, SECRET_NAME, TcpArena, TcpPath, TcpPeerArena
from tests.support.transfer_fakes import SenderProcess, fake_kv, sender_child, wait_for

LAYOUT = WireLayout(2, 2, 16, "float32")  # 512 bytes per token


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run


@pytest.fixture
def path() -> TcpPath:
    return TcpPath(chunk_bytes=8192)  # several chunks per transfer


@pytest.fixture
def arena(path: TcpPath) -> Iterator[TcpArena]:
    a = path.create_arena(1 << 20, "ut-0123abcd")
    yield a
    a.close()


def staged(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.staging_shape(n_tokens), generator=g)


def test_registered_and_probe_works() -> None:
    assert "tcp" in path_factories()
    assert select_path(["tcp"], require="tcp", registry=path_factories()).name == "tcp"


def test_round_trip(path: TcpPath, arena: TcpArena) -> None:
    alloc = RegionAllocator(arena.nbytes)
    peer = path.open_peer_arena(arena.export().meta, [])
    for seed, n_tokens in enumerate((1, 37, 300)):
        x = staged(n_tokens, seed)
        region = alloc.allocate(LAYOUT.staging_nbytes(n_tokens))
        assert region is not None
        tid = secrets.token_hex(16)
        arena.expect(region, tid)
        path.copy_to_peer(x, peer, region.offset, tid=tid)
        assert kv_checksum(arena.region_bytes(region)) == kv_checksum(x)
        arena.forget(region)
        alloc.free(region)
    st = arena.stats()
    assert st.chunks_dropped == 0 and st.expected == 0 and st.chunks_written >= 20


def test_late_chunks_dropped_after_abort_and_region_reuse(path: TcpPath, arena: TcpArena) -> None:
    """D gave up on A and freed its region at once (forget is the proof); B now owns the range. A's
    late copy must not touch it: every chunk is dropped and P hears DROPPED."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(100))
    assert region is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid_a, tid_b = secrets.token_hex(16), secrets.token_hex(16)
    arena.expect(region, tid_a)
    arena.forget(region)  # A failed on D: from here no byte of A may land
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(100, 1), peer, region.offset, tid=tid_a)
    assert not arena.region_bytes(region).any()
    b = staged(100, 2)
    arena.expect(region, tid_b)
    with pytest.raises(TransferError, match="dropped"):  # A again, now into B's range
        path.copy_to_peer(staged(100, 1), peer, region.offset, tid=tid_a)
    path.copy_to_peer(b, peer, region.offset, tid=tid_b)
    assert kv_checksum(arena.region_bytes(region)) == kv_checksum(b)
    assert arena.stats().chunks_dropped >= 2 * (LAYOUT.staging_nbytes(100) // path.chunk_bytes)


def test_chunk_outside_the_expected_range_is_dropped(path: TcpPath, arena: TcpArena) -> None:
    alloc = RegionAllocator(arena.nbytes)
    small = alloc.allocate(LAYOUT.staging_nbytes(10))
    assert small is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid = secrets.token_hex(16)
    arena.expect(small, tid)
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(40, 3), peer, small.offset, tid=tid)  # overruns its region
    assert not arena.region_bytes(small).any()


def test_wrong_secret_is_refused(path: TcpPath, arena: TcpArena, tmp_path: Path) -> None:
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(20))
    assert region is not None
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    other = tmp_path / "other.secret"
    other.write_bytes(os.urandom(32))
    meta = dict(arena.export().meta, secret_path=str(other))
    peer = path.open_peer_arena(meta, [])
    with pytest.raises(TransferError):
        path.copy_to_peer(staged(20, 4), peer, region.offset, tid=tid)
    assert arena.stats().auth_failures == 1
    assert not arena.region_bytes(region).any()


def test_unauthenticated_writer_cannot_write(arena: TcpArena) -> None:
    """A raw client that skips the handshake gets disconnected before any chunk is read."""
    with socket.create_connection((arena.host, arena.port), timeout=2) as s:
        s.recv(36)
        s.sendall(b"\0" * 64 + b"\1" * 200)
        s.settimeout(2)
        with contextlib.suppress(ConnectionResetError):  # a reset: closed with our bytes unread
            assert s.recv(100) == b""  # closed
    assert arena.stats().chunks_written == 0


def test_epoch_mismatch_is_dropped(path: TcpPath, arena: TcpArena) -> None:
    """Chunks addressed to another incarnation of D (a stale epoch) never land."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(20))
    assert region is not None
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    peer = path.open_peer_arena(arena.export().meta, [])
    assert isinstance(peer, TcpPeerArena)
    peer.epoch = os.urandom(16)
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(20, 5), peer, region.offset, tid=tid)
    assert not arena.region_bytes(region).any()
    assert arena.stats().chunks_dropped >= 1


def test_copy_without_transfer_id_is_refused(path: TcpPath, arena: TcpArena) -> None:
    peer = path.open_peer_arena(arena.export().meta, [])
    with pytest.raises(TransferError, match="transfer id"):
        path.copy_to_peer(staged(4, 6), peer, 0)


def test_forget_waits_for_a_chunk_in_progress(path: TcpPath, arena: TcpArena) -> None:
    """Many copies race `forget`: whatever landed landed before it returned; nothing after."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(1000))
    assert region is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            path.copy_to_peer(staged(1000, 7), peer, region.offset, tid=tid)
        except TransferError as exc:
            errors.append(exc)

    t = threading.Thread(target=copy)
    t.start()
    arena.forget(region)
    snapshot = arena.region_bytes(region).clone()
    t.join(10)
    assert torch.equal(snapshot, arena.region_bytes(region))  # no write after forget returned


def test_secret_file_is_private(arena: TcpArena) -> None:
    st = os.stat(arena.secret_path)
    assert arena.secret_path.name == SECRET_NAME and st.st_mode & 0o777 == 0o600 and st.st_size == 32


def test_p_refuses_a_listener_that_fails_authentication(path: TcpPath) -> None:
    """Mutual: P sends no KV to a listener that cannot prove it holds the unit secret."""
    server = socket.create_server(("127.0.0.1", 0))
    got: list[bytes] = []

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(MAGIC + os.urandom(32))
            conn.recv(64)  # P's proof
            conn.sendall(os.urandom(32))  # a made-up answer
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                while chunk := conn.recv(65536):
                    got.append(chunk)

    t = threading.Thread(target=impostor)
    t.start()
    peer = TcpPeerArena("127.0.0.1", server.getsockname()[1], os.urandom(16), 1 << 20, os.urandom(32))
    with pytest.raises(TransferError, match="data listener does not hold the unit secret"):
        path.copy_to_peer(staged(20, 8), peer, 0, tid=secrets.token_hex(16))
    t.join(10)
    server.close()
    assert got == []  # not one chunk header, let alone KV bytes


# ---- the sender and receiver over the TCP path -------------------------------------------------------

UNIT = "ut"
ARENA = 1 << 24
BUSY = (TransferState.REQUESTED, TransferState.DONE)


class ThreadP(SenderProcess):
    """`sender_child` in a thread of this process: the same driver as the spawned child."""

    def __init__(self, xdg: str, control: str = "unix", secret: bytes | None = None) -> None:
        self.pipe, child = mp.Pipe()
        args = (UNIT, "p0", LAYOUT.to_dict(), xdg, child, "tcp", control, secret)
        self.thread = threading.Thread(target=sender_child, args=args, daemon=True)
        self.thread.start()
        assert self.pipe.poll(30), "P thread did not start"
        _, self.instance, self.endpoint = self.pipe.recv()

    def stop(self) -> None:
        if self.thread.is_alive():
            self.call("release")
            self.call("close")
        self.thread.join(10)


@pytest.fixture(params=["unix", "tcp"])
def control(request: pytest.FixtureRequest) -> str:
    """The control plane: the unit socket, or P's TCP listener (cross-host form, on loopback)."""
    return str(request.param)


@pytest.fixture
def secret(runtime_dir: Path) -> bytes:
    return unit_secret(control_dir(UNIT))


@pytest.fixture(params=["thread", "spawn"])
def p(
    request: pytest.FixtureRequest, runtime_dir: Path, control: str, secret: bytes
) -> Iterator[SenderProcess]:
    """P serving over the TCP path, in this process or in a spawned child."""
    key = secret if control == "tcp" else None
    sp = ThreadP(str(runtime_dir), control, key) if request.param == "thread" else None
    sp = sp or SenderProcess(UNIT, str(runtime_dir), LAYOUT, path="tcp", control=control, secret=key)
    assert sp.endpoint.startswith("tcp://") == (control == "tcp")
    yield sp
    sp.stop()


@pytest.fixture
def r(secret: bytes) -> Iterator[TransferReceiver]:
    # lock_proof off: a region must come back through the path's own proof, never the lock.
    rec = TransferReceiver(
        LAYOUT,
        UNIT,
        ARENA,
        TcpPath(),
        abort_retry_s=0.05,
        probe_interval_s=0.1,
        lock_proof=False,
        secret=secret,
    )
    yield rec
    rec.close()


def tcp_arena(r: TransferReceiver) -> TcpArena:
    arena = r._arena
    assert isinstance(arena, TcpArena)
    return arena


def test_sender_receiver_round_trip(p: SenderProcess, r: TransferReceiver) -> None:
    rng = random.Random(7)
    n_chunks_min = 0
    for i in range(40):
        n = 5000 if i % 10 == 0 else rng.randint(1, 600)  # 5000 tokens: three 1 MiB chunks
        n_chunks_min += -(-LAYOUT.staging_nbytes(n) // (1 << 20))
        h = r.request(p.offer(n, i), 10.0)
        assert wait_for(lambda h=h: r.poll(h) not in BUSY)  # type: ignore[misc]
        assert r.poll(h) is TransferState.VERIFIED, h.error  # D hashed the region: checksum matched
        assert torch.equal(h.tensor(), fake_kv(LAYOUT, n, i))
        r.complete(h)
    st, ast, pst = r.stats(), tcp_arena(r).stats(), p.call("stats")
    assert (st.verify_ok, st.verify_mismatch, st.transfers_failed) == (40, 0, 0)
    assert st.free_bytes == ARENA and st.quarantined_count == 0
    assert ast.expected == 0 and ast.chunks_dropped == 0 and ast.chunks_written >= n_chunks_min
    assert (pst["copies_ok"], pst["copies_failed"], pst["sources_released"]) == (40, 0, 40)


def test_blocked_copy_past_deadline_frees_at_once_and_late_chunks_are_dropped(
    p: SenderProcess, r: TransferReceiver
) -> None:
    """D gives up on A while P's copy is stuck before it crosses: the stream fails at the deadline and
    the region is free at that same moment (RECEIVER_DROPS), with no ABORT and no ACK. B then gets the
    same range; when A's copy finally runs, every chunk of it is dropped and B's bytes are untouched."""
    n = 5000  # three chunks
    warm = r.request(p.offer(1, 99), 10.0)  # connect first, so A's PULL surely leaves before its deadline
    assert wait_for(lambda: r.poll(warm) is TransferState.VERIFIED)
    r.complete(warm)

    assert p.call("hook", "block_one") == "ok"
    ha = r.request(p.offer(n, 1), 1.0)
    assert p.call("entered", 5.0), "A's copy never started"
    assert wait_for(lambda: r.poll(ha) is TransferState.FAILED, 3.0)
    assert isinstance(ha.error, TransferTimeout)
    assert ha.region_state is RegionState.FREE and ha.released_by is ReleaseReason.RECEIVER_DROPS
    st = r.stats()
    assert st.released_by_drop == 1 and st.quarantined_count == 0 and r.held_fraction() == 0.0
    assert st.aborts_sent == 0 and st.free_bytes == ARENA
    r.complete(ha)

    hb = r.request(p.offer(n, 2), 10.0)  # block_one: only A's copy is held
    assert hb.region.offset == ha.region.offset  # B owns A's old range
    assert wait_for(lambda: r.poll(hb) is TransferState.VERIFIED), hb.error
    b_bytes = fake_kv(LAYOUT, n, 2)
    assert torch.equal(hb.tensor(), b_bytes)
    dropped_before = tcp_arena(r).stats().chunks_dropped

    assert p.call("release") == "ok"  # A's late copy now streams into B's range

    def copies_ended() -> int:
        pst = p.call("stats")
        return int(pst["copies_ok"] + pst["copies_failed"])

    assert wait_for(lambda: copies_ended() == 3), "A's copy never ended"  # warm-up, B, A
    assert torch.equal(hb.tensor(), b_bytes)  # B's bytes untouched by A's chunks
    assert tcp_arena(r).stats().chunks_dropped >= dropped_before + 3
    r.complete(hb)

    pst = p.call("stats")  # A's copy ended DROPPED: P reported FAILED COPY_ERROR, which D ignores now
    assert (pst["copies_ok"], pst["copies_failed"], pst["held_acks"], pst["acks_sent"]) == (2, 1, 0, 0)
    assert pst["fatal"] == []
    st = r.stats()
    assert st.free_bytes == ARENA and st.aborts_sent == 0 and (st.verify_ok, st.transfers_failed) == (2, 1)


def test_sender_with_a_wrong_secret_is_refused(
    p: SenderProcess, r: TransferReceiver, runtime_dir: Path
) -> None:
    """P reads another secret than D's (the file was replaced after D loaded it): D refuses the data
    connection, nothing is written, P reports the copy failed, and that refusal frees the region."""
    secret = tcp_arena(r).secret_path
    tmp = secret.with_name("new.secret")
    tmp.write_bytes(os.urandom(32))
    tmp.chmod(0o600)
    tmp.replace(secret)
    h = r.request(p.offer(300, 3), 10.0)
    assert wait_for(lambda: r.poll(h) not in BUSY)
    assert r.poll(h) is TransferState.FAILED and isinstance(h.error, CopyFailed), h.error
    assert h.released_by is ReleaseReason.REFUSED and h.region_state is RegionState.FREE
    ast = tcp_arena(r).stats()
    assert ast.auth_failures == 1 and ast.chunks_written == 0 and ast.expected == 0
    assert not tcp_arena(r).region_bytes(h.region).any()
    r.complete(h)
    assert r.stats().free_bytes == ARENA and p.call("stats")["copies_failed"] == 1


# ---- the control plane over TCP: what each bad peer or setting gets ---------------------------------


def test_d_without_the_unit_secret_cannot_pull_over_tcp_control(runtime_dir: Path, secret: bytes) -> None:
    """Tickets of a tcp control plane are signed by P with the unit secret. A D holding another secret
    refuses them before connecting anywhere (nothing allocated); a ticket whose endpoint was altered
    (a forged HANDOFF pointing D at another host) is refused by every D; the right D is served."""
    import dataclasses

    sp = SenderProcess(UNIT, str(runtime_dir), LAYOUT, path="tcp", control="tcp", secret=secret)
    wrong = TransferReceiver(LAYOUT, UNIT, ARENA, TcpPath(), lock_proof=False, secret=os.urandom(32))
    right = TransferReceiver(LAYOUT, UNIT, ARENA, TcpPath(), lock_proof=False, secret=secret)
    try:
        ticket = sp.offer(40, 1)
        assert len(ticket.mac) == 64
        with pytest.raises(TransferError, match="not signed with this unit's secret"):
            wrong.request(ticket, 5.0)
        forged = dataclasses.replace(ticket, endpoint="tcp://127.0.0.1:9")
        with pytest.raises(TransferError, match="not signed with this unit's secret"):
            right.request(forged, 5.0)
        assert wrong.stats().free_bytes == ARENA and right.stats().free_bytes == ARENA
        ok = right.request(ticket, 5.0)
        assert wait_for(lambda: right.poll(ok) not in BUSY)
        assert right.poll(ok) is TransferState.VERIFIED, ok.error
        right.complete(ok)
        assert sp.call("stats")["auth_failures"] == 0
    finally:
        wrong.close()
        right.close()
        sp.stop()


def test_d_with_another_secret_is_refused_by_p(runtime_dir: Path, secret: bytes) -> None:
    """The handshake itself: a D whose secret differs from P's (here it also signed the ticket, as a
    forger would) is refused by P; the transfer fails at once with a clear error, its region free."""
    import dataclasses

    from tandem.transfer.auth import sign_ticket

    sp = SenderProcess(UNIT, str(runtime_dir), LAYOUT, path="tcp", control="tcp", secret=secret)
    other = os.urandom(32)
    d = TransferReceiver(LAYOUT, UNIT, ARENA, TcpPath(), lock_proof=False, secret=other)
    try:
        ticket = sp.offer(40, 2)
        resigned = dataclasses.replace(ticket, mac=sign_ticket(other, ticket.signing_bytes()))
        h = d.request(resigned, 5.0)
        assert wait_for(lambda: d.poll(h) not in BUSY)
        assert d.poll(h) is TransferState.FAILED
        assert "holds another unit secret than ours" in str(h.error), h.error
        d.complete(h)
        assert d.stats().free_bytes == ARENA
        assert wait_for(lambda: sp.call("stats")["auth_failures"] >= 1)
    finally:
        d.close()
        sp.stop()


def test_tcp_control_port_survives_junk_and_half_handshakes(runtime_dir: Path, secret: bytes) -> None:
    """Garbage, a silent connection and a wrong proof on P's control port: each is refused and
    counted; P keeps serving."""
    sp = SenderProcess(UNIT, str(runtime_dir), LAYOUT, path="tcp", control="tcp", secret=secret)
    r = TransferReceiver(LAYOUT, UNIT, ARENA, TcpPath(), lock_proof=False, secret=secret)
    try:
        host, port = sp.endpoint[len("tcp://") :].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as junk:
            junk.recv(36)  # P's magic + nonce
            junk.sendall(os.urandom(64))  # a wrong proof
            assert junk.recv(64) == b""  # P hangs up without proving anything
        with socket.create_connection((host, int(port))) as silent:
            silent.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(64))
        with socket.create_connection((host, int(port))) as trickle:  # one byte every 0.3 s
            trickle.recv(36)
            t0 = time.monotonic()
            with contextlib.suppress(OSError):
                for _ in range(64):
                    trickle.sendall(b"x")
                    time.sleep(0.3)
            # the handshake's deadline is absolute (2 s): P hung up long before 64 bytes
            assert time.monotonic() - t0 < 4.0
        assert wait_for(lambda: sp.call("stats")["auth_failures"] >= 3)
        h = r.request(sp.offer(10, 3), 5.0)
        assert wait_for(lambda: r.poll(h) not in BUSY)
        assert r.poll(h) is TransferState.VERIFIED, h.error
        r.complete(h)
    finally:
        r.close()
        sp.stop()


def test_tcp_control_is_refused_where_d_does_not_write_every_byte(runtime_dir: Path, secret: bytes) -> None:
    """Across hosts there is no instance lock to probe, so P refuses a tcp control plane on a path
    where it writes D's memory, and D refuses to follow a tcp:// ticket on such a path or without
    the unit secret."""
    from tandem.transfer import HostShmPath, Ticket, TransferSender

    with pytest.raises(TransferError, match="cannot use a tcp control plane"):
        TransferSender(LAYOUT, UNIT, HostShmPath(), print, print, control="tcp", secret=secret)
    with pytest.raises(TransferError, match="needs the unit secret"):
        TransferSender(LAYOUT, UNIT, TcpPath(), print, print, control="tcp")
    with pytest.raises(TransferError, match="control must be"):
        TransferSender(LAYOUT, UNIT, TcpPath(), print, print, control="udp")
    from tandem.transfer.auth import sign_ticket

    fp = LAYOUT.fingerprint()
    unsigned = Ticket("a" * 32, "tcp://127.0.0.1:9", "", "b" * 32, 4, LAYOUT.staging_nbytes(4), fp, "tcp")
    ticket = Ticket(**{**unsigned.__dict__, "mac": sign_ticket(secret, unsigned.signing_bytes())})
    shm = TransferReceiver(LAYOUT, UNIT, ARENA, HostShmPath(), secret=secret)
    keyless = TransferReceiver(LAYOUT, UNIT, ARENA, TcpPath())
    try:
        with pytest.raises(TransferError, match="only a path where D writes every byte"):
            shm.request(Ticket(**{**ticket.__dict__, "path": "host_shm"}), 1.0)
        with pytest.raises(TransferError, match="needs the unit secret"):
            keyless.request(ticket, 1.0)
        with pytest.raises(TransferError, match="malformed control endpoint"):
            keyless.request(Ticket(**{**ticket.__dict__, "endpoint": "tcp://nohost"}), 1.0)
        assert shm.stats().free_bytes == ARENA and keyless.stats().free_bytes == ARENA
    finally:
        shm.close()
        keyless.close()
