"""D against a scripted P: the test decides every reply, so duplicates and late messages are exact."""

from __future__ import annotations

import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tandem.transfer import (
    HostShmPath,
    RegionState,
    ReleaseReason,
    Ticket,
    TransferReceiver,
    TransferState,
    TransferTimeout,
    WireLayout,
    kv_checksum,
)
from tandem.transfer._conn import Connection
from tandem.transfer.checksum import format_checksum
from tandem.transfer.control import InstanceLock, endpoint_paths, listen_unix
from tandem.transfer.frames import PROTOCOL_VERSION, MsgType
from tandem.transfer.paths.host_shm import HostPeerArena
from tests.support import transfer_fakes
from tests.support.transfer_fakes import fake_kv

LAYOUT = WireLayout(1, 2, 8, "float32")
ARENA = 1 << 20


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> bool:
    return transfer_fakes.wait_for(pred, timeout)


class ScriptedP:
    """Accepts D, answers HELLO, and queues every later frame for the test to answer by hand."""

    def __init__(self, unit: str) -> None:
        self.instance = secrets.token_hex(16)
        self.sock_path, lock_path = endpoint_paths(unit, "fake")
        self.lock = InstanceLock(lock_path)
        assert self.lock.try_acquire()
        self.srv = listen_unix(self.sock_path)
        self.inbox: queue.Queue[tuple[MsgType, dict[str, Any]]] = queue.Queue()
        self.conn: Connection | None = None
        self.arena: HostPeerArena | None = None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        sock, _ = self.srv.accept()
        self.conn = Connection(sock)
        _, _, fds = self.conn.reader.read()
        arena = HostShmPath().open_peer_arena({"kind": "memfd"}, fds)
        assert isinstance(arena, HostPeerArena)
        self.arena = arena
        self.conn.send(MsgType.HELLO_ACK, v=PROTOCOL_VERSION, instance=self.instance)
        try:
            while True:
                kind, msg, _ = self.conn.reader.read()
                self.inbox.put((kind, msg))
        except (EOFError, OSError):
            pass

    def ticket(self, n: int) -> Ticket:
        return Ticket(
            secrets.token_hex(16),
            str(self.sock_path),
            str(self.lock.path),
            self.instance,
            n,
            LAYOUT.staging_nbytes(n),
            LAYOUT.fingerprint(),
            "host_shm",
        )

    def next(self, kind: MsgType) -> dict[str, Any]:
        while True:
            got, msg = self.inbox.get(timeout=5.0)
            if got is kind:
                return msg

    def write_and_done(self, pull: dict[str, Any], data: torch.Tensor, times: int = 1) -> None:
        assert self.arena is not None and self.conn is not None
        raw = data.reshape(-1).view(torch.uint8)
        self.arena.bytes[pull["offset"] : pull["offset"] + raw.numel()].copy_(raw)
        for _ in range(times):
            self.conn.send(
                MsgType.DONE,
                tid=pull["tid"],
                nbytes=raw.numel(),
                checksum=format_checksum(kv_checksum(data)),
                copy_start_ns=time.time_ns(),
                copy_end_ns=time.time_ns(),
            )

    def close(self) -> None:
        if self.conn is not None:
            self.conn.shutdown()
        self.srv.close()
        self.lock.release()


@pytest.fixture
def rig(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ScriptedP, TransferReceiver]]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path_factory.mktemp("x")))
    p = ScriptedP("fake")
    r = TransferReceiver(LAYOUT, "fake", ARENA, HostShmPath(), abort_retry_s=0.05, probe_interval_s=0.1)
    yield p, r
    r.close()
    p.close()


def test_duplicate_done_and_stray_ack_are_harmless(rig: tuple[ScriptedP, TransferReceiver]) -> None:
    p, r = rig
    data = fake_kv(LAYOUT, 9, 1)
    h = r.request(p.ticket(9), 5.0)
    p.write_and_done(p.next(MsgType.PULL), data, times=3)
    assert wait_for(lambda: r.poll(h) is TransferState.VERIFIED)
    assert p.conn is not None
    p.conn.send(MsgType.ABORT_ACK, tid=h.transfer_id)  # nobody asked: ignored
    p.conn.send(
        MsgType.DONE, tid=secrets.token_hex(16), nbytes=1, checksum="0" * 16, copy_start_ns=0, copy_end_ns=0
    )  # unknown transfer: ignored
    time.sleep(0.1)
    assert torch.equal(h.tensor(), data) and h.region_state is RegionState.READY
    r.complete(h)
    p.write_and_done({"tid": h.transfer_id, "offset": h.region.offset}, torch.zeros_like(data), times=1)
    time.sleep(0.1)  # a DONE for a completed, forgotten transfer changes nothing
    st = r.stats()
    assert (st.transfers_ok, st.verify_ok, st.verify_mismatch, st.free_bytes) == (1, 1, 0, ARENA)
    assert r.poll(h) is TransferState.RELEASED


def test_late_done_after_timeout_releases_and_later_ack_is_ignored(
    rig: tuple[ScriptedP, TransferReceiver],
) -> None:
    p, r = rig
    h = r.request(p.ticket(4), 0.1)
    pull = p.next(MsgType.PULL)
    assert wait_for(lambda: r.poll(h) is TransferState.FAILED) and isinstance(h.error, TransferTimeout)
    assert h.region_state is RegionState.QUARANTINED
    assert p.next(MsgType.ABORT)["tid"] == h.transfer_id
    p.next(MsgType.ABORT)  # re-sent while unanswered
    p.write_and_done(pull, fake_kv(LAYOUT, 4, 2))  # the copy finished after D gave up: proof
    assert wait_for(lambda: h.region_state is RegionState.FREE)
    assert h.released_by is ReleaseReason.DONE and r.poll(h) is TransferState.FAILED
    assert p.conn is not None
    p.conn.send(MsgType.ABORT_ACK, tid=h.transfer_id)
    p.conn.send(MsgType.ABORT_ACK, tid=h.transfer_id)
    time.sleep(0.1)
    st = r.stats()
    assert (st.released_by_done, st.released_by_ack) == (1, 0)
    assert (st.transfers_failed, st.quarantined_count) == (1, 0)
    r.complete(h)
    assert r.stats().free_bytes == ARENA


def test_checksum_mismatch_fails_and_frees(rig: tuple[ScriptedP, TransferReceiver]) -> None:
    p, r = rig
    data = fake_kv(LAYOUT, 6, 3)
    h = r.request(p.ticket(6), 5.0)
    pull = p.next(MsgType.PULL)
    assert p.arena is not None and p.conn is not None
    raw = data.reshape(-1).view(torch.uint8).clone()
    raw[5] ^= 1  # one bit differs from what P hashed
    p.arena.bytes[pull["offset"] : pull["offset"] + raw.numel()].copy_(raw)
    theirs = format_checksum(kv_checksum(data))
    p.conn.send(
        MsgType.DONE, tid=pull["tid"], nbytes=raw.numel(), checksum=theirs, copy_start_ns=0, copy_end_ns=0
    )
    assert wait_for(lambda: r.poll(h) is TransferState.FAILED)
    assert type(h.error).__name__ == "ChecksumMismatch" and h.region_state is RegionState.FREE
    assert r.stats().verify_mismatch == 1
    r.complete(h)
