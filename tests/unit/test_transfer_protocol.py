"""Sender and receiver in one process: round trips, refusals, quarantine and its proofs, bad peers."""

from __future__ import annotations

import dataclasses
import secrets
import socket
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tandem.transfer import (
    HostShmPath,
    LayoutMismatch,
    RegionState,
    ReleaseReason,
    SenderClosed,
    Ticket,
    TransferEvent,
    TransferExpired,
    TransferHandle,
    TransferReceiver,
    TransferSender,
    TransferState,
    TransferTimeout,
    UnknownTransfer,
    WireLayout,
)
from tandem.transfer.control import connect_unix
from tandem.transfer.frames import PROTOCOL_VERSION, FrameReader, MsgType, encode, send_frame
from tests.support import transfer_fakes
from tests.support.transfer_fakes import HookControl, fake_kv

LAYOUT = WireLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_name="bfloat16")
ARENA = 1 << 22


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    return transfer_fakes.wait_for(pred, timeout)


def settle(r: TransferReceiver, h: TransferHandle, timeout: float = 5.0) -> TransferState:
    assert wait_for(lambda: r.poll(h) not in (TransferState.REQUESTED, TransferState.DONE), timeout)
    return r.poll(h)


@dataclasses.dataclass
class Pair:
    s: TransferSender
    r: TransferReceiver
    hook: HookControl
    released: list[str]
    fatal: list[str]
    events: list[TransferEvent]
    quarantine: list[tuple[str, bool]]

    def offer(self, n: int, seed: int = 0, ttl: float = 5.0) -> tuple[Ticket, torch.Tensor]:
        data = fake_kv(LAYOUT, n, seed)
        return self.s.offer(n, lambda out: out.copy_(data), ttl), data


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("x"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    return d


def make_pair(copy_workers: int = 2) -> Pair:
    hook = HookControl()
    released: list[str] = []
    fatal: list[str] = []
    events: list[TransferEvent] = []
    quarantine: list[tuple[str, bool]] = []
    s = TransferSender(
        LAYOUT, "u", HostShmPath(), released.append, fatal.append, copy_hook=hook, copy_workers=copy_workers
    )
    hook.sender = s
    s.start()
    r = TransferReceiver(
        LAYOUT,
        "u",
        ARENA,
        HostShmPath(),
        abort_retry_s=0.05,
        probe_interval_s=0.1,
        on_event=events.append,
        on_quarantine_change=lambda t, q: quarantine.append((t, q)),
    )
    return Pair(s, r, hook, released, fatal, events, quarantine)


@pytest.fixture
def pair(xdg: str) -> Iterator[Pair]:
    p = make_pair()
    yield p
    p.hook.gate.set()
    p.r.close()
    p.s.close()


def test_round_trip_sizes_verified_and_nothing_leaks(pair: Pair) -> None:
    sizes = [1, 3, 64, 257, 1000]
    for i, n in enumerate(sizes):
        ticket, data = pair.offer(n, seed=i)
        h = pair.r.request(ticket, 5.0)
        assert settle(pair.r, h) is TransferState.VERIFIED
        assert h.tensor().shape == LAYOUT.staging_shape(n)
        assert torch.equal(h.tensor().view(torch.int16), data.view(torch.int16))
        pair.r.complete(h)
        assert h.state is TransferState.RELEASED
    st = pair.r.stats()
    assert st.free_bytes == ARENA and st.transfers_ok == len(sizes) and st.verify_mismatch == 0
    assert st.bytes_moved == sum(LAYOUT.staging_nbytes(n) for n in sizes)
    assert wait_for(lambda: pair.s.stats().offers_open == 0)
    assert len(pair.released) == len(set(pair.released)) == len(sizes)
    assert [e.state for e in pair.events] == ["VERIFIED"] * len(sizes)
    for e in pair.events:
        stages = [e.request_sent_ns, e.copy_start_ns, e.copy_end_ns, e.done_received_ns, e.verified_ns]
        assert stages[0] > 0 and stages == sorted(stages)
    assert pair.quarantine == [] and pair.r.held_fraction() == 0.0


def test_unknown_expired_and_repulled_tickets_fail_without_quarantine(pair: Pair) -> None:
    ticket, _ = pair.offer(4)
    forged = dataclasses.replace(ticket, transfer_id=secrets.token_hex(16))
    h = pair.r.request(forged, 5.0)
    assert settle(pair.r, h) is TransferState.FAILED and isinstance(h.error, UnknownTransfer)
    assert h.region_state is RegionState.FREE and h.released_by is ReleaseReason.REFUSED
    pair.r.complete(h)

    expiring, _ = pair.offer(4, ttl=0.05)
    assert wait_for(lambda: expiring.transfer_id in pair.released)
    h = pair.r.request(expiring, 5.0)
    assert settle(pair.r, h) is TransferState.FAILED and isinstance(h.error, TransferExpired)
    assert h.region_state is RegionState.FREE
    pair.r.complete(h)

    h = pair.r.request(ticket, 5.0)
    assert settle(pair.r, h) is TransferState.VERIFIED
    pair.r.complete(h)
    h = pair.r.request(ticket, 5.0)  # pulled once already
    assert settle(pair.r, h) is TransferState.FAILED and isinstance(h.error, UnknownTransfer)
    pair.r.complete(h)

    # A PULL whose deadline already passed is refused before starting; that refusal frees the region.
    late, _ = pair.offer(4)
    h = pair.r.request(late, 0.0)
    assert settle(pair.r, h) is TransferState.FAILED
    assert wait_for(lambda: h.region_state is RegionState.FREE)
    assert h.released_by in (ReleaseReason.REFUSED, ReleaseReason.NEVER_SENT)
    pair.r.complete(h)
    assert wait_for(lambda: pair.s.stats().offers_open == 0)
    assert pair.r.stats().quarantined_count == 0 and pair.r.stats().free_bytes == ARENA
    assert sorted(pair.released) == sorted(set(pair.released))


def test_deadline_with_blocked_copy_quarantines_until_abort_ack(pair: Pair) -> None:
    pair.hook.mode = "block"
    ticket, _data = pair.offer(300)
    t0 = time.monotonic()
    h = pair.r.request(ticket, 0.2)
    assert pair.hook.entered.wait(2.0)
    assert settle(pair.r, h) is TransferState.FAILED
    assert time.monotonic() - t0 < 0.6 and isinstance(h.error, TransferTimeout)
    assert h.region_state is RegionState.QUARANTINED
    assert pair.quarantine == [(h.transfer_id, True)]
    assert pair.r.held_fraction() == pytest.approx(h.region.alloc_bytes / ARENA)
    pair.r.complete(h)  # the engine is done with it; the region is not the engine's to free
    before = pair.r.stats().aborts_sent
    time.sleep(0.4)  # many abort_retry_s periods: time alone must not release it
    assert h.region_state is RegionState.QUARANTINED and pair.r.stats().aborts_sent >= before + 3
    assert pair.s.stats().held_acks == 1
    region = pair.r._arena.region_bytes(h.region)
    assert int(region.count_nonzero()) == 0  # the blocked copy has not written yet
    pair.hook.gate.set()
    assert wait_for(lambda: h.region_state is RegionState.FREE)
    assert h.released_by is ReleaseReason.ABORT_ACK
    assert pair.quarantine == [(h.transfer_id, True), (h.transfer_id, False)]
    assert pair.s.stats().held_acks == 0 and pair.r.stats().free_bytes == ARENA
    assert pair.r.held_fraction() == 0.0 and [e.state for e in pair.events] == ["FAILED"]
    assert "TransferTimeout" in (pair.events[0].error or "")


def test_three_held_acks_make_p_fatal(xdg: str) -> None:
    p = make_pair(copy_workers=3)
    try:
        p.hook.mode = "block"
        handles = [p.r.request(p.offer(8, seed=i)[0], 0.15) for i in range(3)]
        for h in handles:
            assert settle(p.r, h) is TransferState.FAILED
        assert wait_for(lambda: len(p.fatal) == 1)
        assert "held" in p.fatal[0] and p.s.stats().held_acks == 3
        with pytest.raises(SenderClosed):
            p.offer(1)
        assert all(h.region_state is RegionState.QUARANTINED for h in handles)
        p.hook.gate.set()
        assert wait_for(lambda: all(h.region_state is RegionState.FREE for h in handles))
        assert {h.released_by for h in handles} == {ReleaseReason.ABORT_ACK} and len(p.fatal) == 1
    finally:
        p.hook.gate.set()
        p.r.close()
        p.s.close()


def test_layout_mismatch_is_refused_before_any_write(pair: Pair) -> None:
    other = WireLayout(2, 2, 8, "bfloat16")
    r2 = TransferReceiver(other, "u", ARENA, HostShmPath())
    try:
        ticket, _ = pair.offer(5)
        with pytest.raises(LayoutMismatch):
            r2.request(ticket, 1.0)
        assert r2.stats().free_bytes == ARENA
        # A ticket doctored to pass D's check still meets P's HELLO check.
        forged = dataclasses.replace(ticket, layout_fp=other.fingerprint(), nbytes=other.staging_nbytes(5))
        h = r2.request(forged, 2.0)
        assert settle(r2, h) is TransferState.FAILED and isinstance(h.error, LayoutMismatch)
        assert h.region_state is RegionState.FREE and h.released_by is ReleaseReason.NEVER_SENT
        assert int(r2._arena.region_bytes(h.region).count_nonzero()) == 0
    finally:
        r2.close()


def test_malformed_frames_close_only_that_connection(pair: Pair) -> None:
    ticket, data = pair.offer(7)
    bad_frames = [
        b"\x00\x00\x00\x05hello",
        b"\xff\xff\xff\xff",
        encode(MsgType.PING, nonce=1),
        encode(MsgType.ABORT, tid=7),
    ]
    for bad in bad_frames:
        sock = connect_unix(ticket.endpoint, 1.0)
        sock.sendall(bad)
        sock.settimeout(2.0)
        assert sock.recv(100) == b""  # P closed it
        sock.close()
    h = pair.r.request(ticket, 5.0)
    assert settle(pair.r, h) is TransferState.VERIFIED
    assert torch.equal(h.tensor().view(torch.int16), data.view(torch.int16))
    pair.r.complete(h)


def _raw_d(endpoint: str) -> tuple[socket.socket, FrameReader, object]:
    arena = HostShmPath().create_arena(1 << 20, "raw")
    exp = arena.export()
    sock = connect_unix(endpoint, 1.0)
    send_frame(
        sock,
        encode(
            MsgType.HELLO,
            v=PROTOCOL_VERSION,
            layout=LAYOUT.to_dict(),
            layout_fp=LAYOUT.fingerprint(),
            path="host_shm",
            arena=exp.meta,
            d_instance="d" * 32,
        ),
        exp.fds,
    )
    reader = FrameReader(sock)
    kind, _msg, _ = reader.read()
    assert kind is MsgType.HELLO_ACK
    return sock, reader, arena


def test_p_ignores_duplicate_pull_and_acks_every_abort(pair: Pair) -> None:
    ticket, _ = pair.offer(3)
    tid = ticket.transfer_id
    sock, reader, _arena = _raw_d(ticket.endpoint)
    pull = encode(MsgType.PULL, tid=tid, offset=0, nbytes=LAYOUT.staging_nbytes(3), remaining_ms=5000)
    sock.sendall(pull)
    assert reader.read()[0] is MsgType.DONE
    sock.sendall(pull)
    kind, msg, _ = reader.read()
    assert kind is MsgType.FAILED and msg["tid"] == tid
    for _ in range(2):
        sock.sendall(encode(MsgType.ABORT, tid=tid))
        assert reader.read()[:2] == (MsgType.ABORT_ACK, {"type": int(MsgType.ABORT_ACK), "tid": tid})
    sock.sendall(encode(MsgType.PULL, tid=tid, offset=1 << 30, nbytes=1, remaining_ms=5000))
    assert reader.read()[0] is MsgType.FAILED
    sock.close()
    assert pair.released.count(tid) == 1


def test_unpulled_offers_released_once_on_close(xdg: str) -> None:
    p = make_pair()
    tickets = [p.offer(2, seed=i)[0] for i in range(4)]
    p.r.close()
    p.s.close()
    assert sorted(p.released) == sorted(t.transfer_id for t in tickets)


def test_an_fp8_d_and_a_bf16_p_refuse_each_other_naming_both_layouts(pair: Pair) -> None:
    """tandem.kv.dtype=fp8 on one side only: same geometry, other bytes (and scales). D refuses P's
    ticket at once; a ticket doctored past D's check meets P's HELLO, whose error names both KVs."""
    fp8 = WireLayout(2, 2, 16, "float8_e4m3fn", scale_digest="00ff00ff00ff00ff")
    assert fp8.fingerprint() != LAYOUT.fingerprint() and "scale_digest" not in LAYOUT.to_dict()
    r2 = TransferReceiver(fp8, "u", ARENA, HostShmPath())
    try:
        ticket, _ = pair.offer(4)
        with pytest.raises(LayoutMismatch, match=r"float8_e4m3fn \(scales 00ff00ff00ff00ff\).*same KV dtype"):
            r2.request(ticket, 1.0)
        forged = dataclasses.replace(ticket, layout_fp=fp8.fingerprint(), nbytes=fp8.staging_nbytes(4))
        h = r2.request(forged, 2.0)
        assert settle(r2, h) is TransferState.FAILED and isinstance(h.error, LayoutMismatch)
        assert "float8_e4m3fn" in str(h.error) and "bfloat16" in str(h.error)
        assert (
            h.region_state is RegionState.FREE and int(r2._arena.region_bytes(h.region).count_nonzero()) == 0
        )
    finally:
        r2.close()
