"""Direct mode: D's arena is its KV pool, P writes the prompt's rows straight into D's pages.

What must hold (docs/transfer.md, docs/protocol.md): the rows land in place at exactly the slots D
named, fragmented on both sides; D verifies them in place; a failed transfer's slots go back to D's
engine (`on_dest_free`, exactly once) only after the engine completed the handle *and* a proof says no
byte can still land — the same proofs as a receive region, never time. Bad destinations are refused
before anything is sent; a P that cannot write directly refuses the PULL_ROWS (NO_DIRECT).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.transfer import (
    ChecksumMismatch,
    HostShmPath,
    RegionState,
    ReleaseReason,
    Ticket,
    TransferError,
    TransferHandle,
    TransferReceiver,
    TransferSender,
    TransferState,
    WireLayout,
)
from tandem.transfer._offer import Peer
from tandem.transfer.checksum import kv_checksum, kv_checksum_rows
from tandem.transfer.control import connect_unix
from tandem.transfer.frames import (
    PROTOCOL_VERSION,
    FailReason,
    FrameReader,
    MsgType,
    compress_runs,
    encode,
    expand_runs,
    send_frame,
)
from tandem.transfer.paths.tcp import TcpPath
from tandem.transfer.pull_checks import bad_dst
from tests.support import transfer_fakes
from tests.support.transfer_fakes import HookControl, SenderProcess, fake_kv, fake_pool

LAYOUT = WireLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_name="bfloat16")
POOL_SLOTS = 4096
POOL_BYTES = POOL_SLOTS * LAYOUT.token_bytes
BUSY = (TransferState.REQUESTED, TransferState.DONE)


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    return transfer_fakes.wait_for(pred, timeout)


def settle(r: TransferReceiver, h: TransferHandle, timeout: float = 5.0) -> TransferState:
    assert wait_for(lambda: r.poll(h) not in BUSY, timeout)
    return r.poll(h)


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("x"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    return d


class Freed:
    """An `on_dest_free` that records each call (it must come exactly once, and only when allowed)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@dataclasses.dataclass
class Direct:
    s: TransferSender
    r: TransferReceiver
    released: list[str]
    rng: random.Random

    def offer(self, n: int, seed: int, ttl: float = 5.0, rows: bool = True) -> tuple[Ticket, torch.Tensor]:
        pool, slots = fake_pool(LAYOUT, n, seed)
        ticket = self.s.offer(
            n, lambda out: out.copy_(pool.index_select(2, slots)), ttl, rows=(pool, slots) if rows else None
        )
        return ticket, fake_kv(LAYOUT, n, seed)

    def dest(self, n: int) -> np.ndarray:
        """`n` random slots of D's pool (a shuffled, fragmented destination)."""
        return np.asarray(self.rng.sample(range(POOL_SLOTS), n), dtype=np.int64)


def make_direct(hook: Callable[[str, torch.Tensor], None] | None = None) -> Direct:
    released: list[str] = []
    s = TransferSender(LAYOUT, "dir", HostShmPath(), released.append, lambda _: None, copy_hook=hook)
    if isinstance(hook, HookControl):
        hook.sender = s
    s.start()
    r = TransferReceiver(
        LAYOUT, "dir", POOL_BYTES, HostShmPath(), abort_retry_s=0.05, probe_interval_s=0.1, direct=True
    )
    return Direct(s, r, released, random.Random(7))


@pytest.fixture
def direct(xdg: str) -> Iterator[Direct]:
    d = make_direct()
    yield d
    d.r.close()
    d.s.close()


@pytest.fixture
def hooked(xdg: str) -> Iterator[tuple[Direct, HookControl]]:
    hook = HookControl()
    d = make_direct(hook)
    yield d, hook
    hook.gate.set()
    d.r.close()
    d.s.close()


def test_runs_round_trip_and_compress_fragmentation() -> None:
    rng = np.random.default_rng(0)
    for slots in (np.arange(5, 70), rng.permutation(1000)[:300], np.array([3]), np.array([9, 10, 11, 2, 3])):
        runs = compress_runs(slots)
        assert np.array_equal(expand_runs(runs), slots)
    assert compress_runs(np.arange(100, 164)) == [100, 64]  # one page: one run
    assert expand_runs([]).size == 0


def test_rows_land_in_place_at_fragmented_slots(direct: Direct) -> None:
    pool = direct.r.pool_view()
    assert tuple(pool.shape) == LAYOUT.staging_shape(POOL_SLOTS)
    for i, n in enumerate((1, 17, 300, 1024)):
        ticket, data = direct.offer(n, seed=i)
        dest, freed = direct.dest(n), Freed()
        h = direct.r.request(ticket, 5.0, dest, freed)
        assert settle(direct.r, h) is TransferState.VERIFIED, h.error
        got = pool.index_select(2, torch.from_numpy(dest))
        assert torch.equal(got.view(torch.int16), data.view(torch.int16))
        with pytest.raises(TransferError, match="directly"):
            h.tensor()  # direct mode has no region to read: the KV is already in D's pages
        direct.r.complete(h)
        assert freed.calls == 0  # a verified transfer's slots are simply the engine's
    st = direct.r.stats()
    assert (st.verify_ok, st.transfers_failed, st.quarantined_count) == (4, 0, 0)
    assert st.free_bytes == st.arena_bytes == POOL_BYTES
    assert wait_for(lambda: len(direct.released) == 4)  # P's source rows released after each write


class HashingPath(HostShmPath):
    """A host path that, like the GPU paths' fused kernel, reports the checksum of the rows it wrote
    (`skew` added, to show that the sender sends exactly what the path reported)."""

    def __init__(self, skew: int) -> None:
        super().__init__()
        self.skew = skew
        self.hashed = 0

    def write_rows(self, layout, src, src_slots, peer, dst_slots):  # type: ignore[no-untyped-def]
        super().write_rows(layout, src, src_slots, peer, dst_slots)
        self.hashed += 1
        return (kv_checksum_rows(src, src_slots) + self.skew) % (1 << 64)


@pytest.mark.parametrize("skew", [0, 1])
def test_a_path_that_hashes_its_write_supplies_the_checksum(xdg: str, skew: int) -> None:
    """The checksum in DONE is the one the path's write reported (the GPU paths hash in the write's
    kernel, no pass of their own): right, D verifies; off by one, D's in-place hash catches it."""
    path = HashingPath(skew)
    released: list[str] = []
    s = TransferSender(LAYOUT, "dir", path, released.append, lambda _: None)
    s.start()
    r = TransferReceiver(LAYOUT, "dir", POOL_BYTES, HostShmPath(), abort_retry_s=0.05, direct=True)
    try:
        d = Direct(s, r, released, random.Random(3))
        ticket, data = d.offer(40, seed=5)
        want = kv_checksum(data.contiguous())
        h = r.request(ticket, 5.0, d.dest(40), Freed())
        state = settle(r, h)
        assert path.hashed == 1
        assert state is (TransferState.VERIFIED if skew == 0 else TransferState.FAILED), h.error
        if skew:
            assert isinstance(h.error, ChecksumMismatch)
            assert f"P sent {(want + 1) % (1 << 64):016x}, region hashes to {want:016x}" in str(h.error)
            assert r.stats().verify_mismatch == 1
        r.complete(h)
    finally:
        r.close()
        s.close()


def test_blocked_write_quarantines_slots_until_abort_ack(hooked: tuple[Direct, HookControl]) -> None:
    """The write is still pending when D gives up: the slots stay out until P's ACK, and P's late
    write has landed in them by the time they come back (it is the ACK's proof)."""
    d, hook = hooked
    hook.set_mode("until_abort")  # the write proceeds only once P holds an ABORT_ACK for it
    ticket, data = d.offer(64, seed=1)
    dest = d.dest(64)
    landed: list[bool] = []

    def on_free() -> None:
        got = d.r.pool_view().index_select(2, torch.from_numpy(dest))
        landed.append(torch.equal(got.view(torch.int16), data.view(torch.int16)))

    h = d.r.request(ticket, 0.3, dest, on_free)
    assert settle(d.r, h, 3.0) is TransferState.FAILED
    d.r.complete(h)
    assert wait_for(lambda: bool(landed), 5.0)
    assert landed == [True] and h.released_by is ReleaseReason.ABORT_ACK
    assert d.r.stats().free_bytes == POOL_BYTES


def test_slots_of_a_refused_pull_return_at_complete_not_before(direct: Direct) -> None:
    ticket, _ = direct.offer(32, seed=2, rows=False)  # this offer cannot be written in place
    freed = Freed()
    h = direct.r.request(ticket, 5.0, direct.dest(32), freed)
    assert settle(direct.r, h) is TransferState.FAILED
    assert "NO_DIRECT" in str(h.error) and h.released_by is ReleaseReason.REFUSED
    assert freed.calls == 0  # proof is there, but the engine has not completed the handle yet
    direct.r.complete(h)
    assert freed.calls == 1


def test_corrupted_write_is_caught_in_place_and_slots_return(xdg: str) -> None:
    def corrupt(tid: str, staging: torch.Tensor) -> None:
        flat = staging.reshape(-1).view(torch.uint8)
        flat[flat.numel() // 3] ^= 0x40  # after P's checksum: what lands differs from what P hashed

    d = make_direct(corrupt)
    try:
        ticket, _ = d.offer(128, seed=3)
        freed = Freed()
        h = d.r.request(ticket, 5.0, d.dest(128), freed)
        assert settle(d.r, h) is TransferState.FAILED
        assert "ChecksumMismatch" in type(h.error).__name__ and h.released_by is ReleaseReason.DONE
        d.r.complete(h)
        assert freed.calls == 1 and d.r.stats().verify_mismatch == 1
    finally:
        d.r.close()
        d.s.close()


def test_bad_destinations_are_refused_before_anything_is_sent(direct: Direct) -> None:
    ticket, _ = direct.offer(16, seed=4)
    r = direct.r
    bad: list[tuple[Any, str]] = [
        (None, "16 int64 destination slots"),  # direct mode needs the slots
        (np.arange(16, dtype=np.int32), "16 int64"),  # wrong dtype
        (np.arange(15, dtype=np.int64), "16 int64"),  # wrong length
        (np.arange(POOL_SLOTS - 8, POOL_SLOTS + 8, dtype=np.int64), "outside the pool"),
        (np.arange(-1, 15, dtype=np.int64), "outside the pool"),
    ]
    for dest, msg in bad:
        with pytest.raises(TransferError, match=msg):
            r.request(ticket, 5.0, dest, Freed())
    assert r.stats().in_flight_count == 0  # nothing was allocated or sent
    h = r.request(ticket, 5.0, direct.dest(16), Freed())  # the same ticket still works afterwards
    assert settle(r, h) is TransferState.VERIFIED
    r.complete(h)


def test_region_mode_and_non_direct_paths_refuse_direct_use(xdg: str) -> None:
    r = TransferReceiver(LAYOUT, "reg", 1 << 20, HostShmPath())
    try:
        with pytest.raises(TransferError, match="pool_view"):
            r.pool_view()  # region mode has no pool
        ticket = Ticket("a" * 32, r._dir.as_posix() + "/p0.sock", r._dir.as_posix() + "/p0.lock", "b" * 32,
                        4, LAYOUT.staging_nbytes(4), LAYOUT.fingerprint(), "host_shm")  # fmt: skip
        with pytest.raises(TransferError, match="region-mode"):
            r.request(ticket, 1.0, np.arange(4, dtype=np.int64))
    finally:
        r.close()
    with pytest.raises(TransferError, match="cannot write D's pool directly"):
        TransferReceiver(LAYOUT, "tcpd", POOL_BYTES, TcpPath(), direct=True)  # D writes tcp bytes itself
    with pytest.raises(TransferError, match="not a pool"):
        TransferReceiver(LAYOUT, "odd", POOL_BYTES + 3, HostShmPath(), direct=True)


def test_p_refuses_pull_rows_it_cannot_write(xdg: str) -> None:
    """P checks a PULL_ROWS's runs against D's pool before queueing any write (answer: BAD_REGION)."""
    peer = Peer(conn=None, arena=SimpleNamespace(nbytes=POOL_BYTES))  # type: ignore[arg-type]
    n = 8
    nbytes = LAYOUT.staging_nbytes(n)
    assert bad_dst(LAYOUT, peer.arena, [0, n], nbytes) is None
    assert bad_dst(LAYOUT, peer.arena, [10, 3, 100, 5], nbytes) is None
    for dst, why in [
        ([0, n, 5], "pairs"),  # odd length
        ([0, "8"], "pairs"),  # not ints
        ([0, 0, 8, n], "outside"),  # empty run
        ([-1, n], "outside"),  # negative slot
        ([POOL_SLOTS - 4, n], "outside"),  # past D's pool
        ([0, n + 1], "destination slots for"),  # total is not the offer's size
    ]:
        bad = bad_dst(LAYOUT, peer.arena, dst, nbytes)
        assert bad is not None and why in bad, (dst, bad)
    odd = Peer(conn=None, arena=SimpleNamespace(nbytes=POOL_BYTES + 1))  # type: ignore[arg-type]
    assert "not a pool" in (bad_dst(LAYOUT, odd.arena, [0, n], nbytes) or "")
    assert FailReason.NO_DIRECT.name == "NO_DIRECT"


def test_p_answers_bad_pull_rows_and_releases_the_offer(direct: Direct) -> None:
    """Through a raw D connection: a PULL_ROWS whose slots reach past D's pool gets FAILED
    (BAD_REGION), one for an offer made without its rows gets FAILED (NO_DIRECT); nothing is
    written and both offers' source pages are released at once (not after the ticket's TTL)."""
    arena = HostShmPath().create_arena(POOL_BYTES, "raw")
    exp = arena.export()
    ticket, _ = direct.offer(8, seed=9)
    no_rows, _ = direct.offer(8, seed=10, rows=False)
    sock = connect_unix(ticket.endpoint, 1.0)
    hello = dict(layout=LAYOUT.to_dict(), layout_fp=LAYOUT.fingerprint(), path="host_shm", arena=exp.meta)
    send_frame(sock, encode(MsgType.HELLO, v=PROTOCOL_VERSION, d_instance="d" * 32, **hello), exp.fds)
    reader = FrameReader(sock)
    assert reader.read()[0] is MsgType.HELLO_ACK
    nbytes = LAYOUT.staging_nbytes(8)
    for t, runs, reason in [
        (ticket.transfer_id, [POOL_SLOTS - 4, 8], FailReason.BAD_REGION),  # "run [4092, 8] outside ..."
        (no_rows.transfer_id, [0, 8], FailReason.NO_DIRECT),
    ]:
        sock.sendall(encode(MsgType.PULL_ROWS, tid=t, dst=runs, nbytes=nbytes, remaining_ms=5000))
        kind, msg, _ = reader.read()
        assert (kind, msg["tid"], msg["reason"]) == (MsgType.FAILED, t, int(reason))
        assert msg["detail"].startswith(reason.name)  # BAD_REGION also says which run was wrong
        assert wait_for(lambda t=t: t in direct.released)  # type: ignore[misc]
    assert not arena.pool_view(LAYOUT).view(torch.int16).any()  # nothing was written
    sock.close()
    arena.close()


def test_killed_p_slots_held_until_its_lock_is_free(xdg: str) -> None:
    """A real P process is killed while its copy is held (inside the copy, before its write): the
    slots come back by the lock proof, not by time."""
    p = SenderProcess("kill", xdg, LAYOUT)
    r = TransferReceiver(
        LAYOUT, "kill", POOL_BYTES, HostShmPath(), abort_retry_s=0.05, probe_interval_s=0.1, direct=True
    )
    freed = Freed()
    try:
        p.call("hook", "block")
        ticket = p.offer(64, 5)
        h = r.request(ticket, 0.3, np.arange(1000, 1064, dtype=np.int64), freed)
        assert p.call("entered", 5.0), "write never started"
        assert settle(r, h, 3.0) is TransferState.FAILED
        r.complete(h)
        assert h.region_state is RegionState.QUARANTINED and freed.calls == 0  # P is alive and writing
        p.kill()
        assert wait_for(lambda: freed.calls == 1, 10.0)
        assert h.released_by is ReleaseReason.INSTANCE_GONE
    finally:
        r.close()
        if p.proc.is_alive() and p.proc.pid is not None:
            os.kill(p.proc.pid, signal.SIGKILL)
        p.stop()


def test_child_p_writes_many_fragmented_transfers(xdg: str) -> None:
    p = SenderProcess("many", xdg, LAYOUT)
    r = TransferReceiver(LAYOUT, "many", POOL_BYTES, HostShmPath(), direct=True)
    rng = random.Random(11)
    free = list(range(POOL_SLOTS))
    rng.shuffle(free)
    try:
        for i in range(40):
            n = rng.randint(1, 90)
            dest = np.asarray(free[:n], dtype=np.int64)
            free = free[n:] + free[:n]
            h = r.request(p.offer(n, i), 10.0, dest, Freed())
            assert settle(r, h, 10.0) is TransferState.VERIFIED, h.error
            got = r.pool_view().index_select(2, torch.from_numpy(dest))
            assert torch.equal(got.view(torch.int16), fake_kv(LAYOUT, n, i).view(torch.int16))
            r.complete(h)
        assert p.call("stats")["sources_released"] == 40
    finally:
        r.close()
        p.stop()


def test_pool_over_external_storage_is_checked_and_zeroed() -> None:
    layout = KVLayout(2, 2, 16, torch.bfloat16)
    storage = torch.full(layout.staging_shape(64), 7.0, dtype=torch.bfloat16)
    pool = KVPool(layout, 4, 16, "cpu", storage)
    assert pool.kv.data_ptr() == storage.data_ptr() and not storage.any()  # used in place, zero-filled
    for bad in (
        torch.zeros(layout.staging_shape(63), dtype=torch.bfloat16),  # wrong slot count
        torch.zeros(layout.staging_shape(64), dtype=torch.float16),  # wrong dtype
    ):
        with pytest.raises(ValueError, match="pool storage"):
            KVPool(layout, 4, 16, "cpu", bad)


def test_proxy_refuses_write_rows_slots_outside_its_registrations() -> None:
    """The sidecar checks a write_rows request's slots before touching a GPU (answer: TransferError,
    sent back as `{ok: false}`; nothing is written)."""
    from tandem.transfer.paths.proxy_sidecar import _slots, encode_slots

    slots = np.asarray([4, 5, 6, 20, 21, 63], dtype=np.int64)
    assert list(_slots(encode_slots(slots), 64, "dst")) == list(slots)
    assert _slots(encode_slots(np.zeros(0, dtype=np.int64)), 64, "dst").size == 0
    for text, why in [
        (encode_slots(np.asarray([3, 64])), "outside"),  # past the registered rows
        (encode_slots(np.asarray([-1, 2])), "outside"),  # negative
        ("not base64!", "base64"),  # not base64
        ("AAA=", "base64"),  # 2 bytes: not whole int32s
        ([4, 3], "base64"),  # not a string
    ]:
        with pytest.raises(TransferError, match=why):
            _slots(text, 64, "dst")
