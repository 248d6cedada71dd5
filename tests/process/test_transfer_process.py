"""P in a real child process: many transfers, SIGSTOP/SIGCONT, SIGKILL with and without a restart.

These are the properties about processes: a paused P must still be chased with ABORT until it answers,
a draining D must discover a restarted P by probing, and a dead P's region is released only by a proof
(new instance id, or its instance lock free when that proof is enabled) — never by time.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.transfer import (
    HostShmPath,
    RegionState,
    ReleaseReason,
    TransferHandle,
    TransferReceiver,
    TransferState,
    WireLayout,
)
from tests.support.transfer_fakes import SenderProcess, fake_kv, wait_for

LAYOUT = WireLayout(2, 2, 32, "bfloat16")
ARENA = 1 << 24
BUSY = (TransferState.REQUESTED, TransferState.DONE)


class ChildP(SenderProcess):
    def __init__(self, unit: str, xdg: str, slot: str = "p0") -> None:
        super().__init__(unit, xdg, LAYOUT, slot=slot)


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("x"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    return d


@pytest.fixture
def children() -> Iterator[list[ChildP]]:
    started: list[ChildP] = []
    yield started
    for c in started:
        c.stop()  # resumes a stopped child first


def receiver(**kw: Any) -> TransferReceiver:
    return TransferReceiver(
        LAYOUT, "proc", ARENA, HostShmPath(), abort_retry_s=0.05, probe_interval_s=0.1, **kw
    )


def fail_with_copy_blocked(p: ChildP, r: TransferReceiver, mode: str) -> TransferHandle:
    p.call("hook", mode)
    h = r.request(p.offer(64, 1), 0.3)
    assert p.call("entered", 5.0), "copy never started"
    return h


def test_cross_process_random_transfers_all_verified(xdg: str, children: list[ChildP]) -> None:
    p = ChildP("proc", xdg)
    children.append(p)
    r = receiver()
    rng = random.Random(1234)
    try:
        pending: list[tuple[TransferHandle, int, int]] = []
        done = 0
        for i in range(200):
            n, seed = rng.randint(1, 400), rng.randrange(1 << 30)
            pending.append((r.request(p.offer(n, seed), 10.0), n, seed))
            while len(pending) >= 4 or (i == 199 and pending):
                h, n0, s0 = pending.pop(0)
                assert wait_for(lambda h=h: r.poll(h) not in BUSY)  # type: ignore[misc]
                assert r.poll(h) is TransferState.VERIFIED, h.error
                assert torch.equal(h.tensor().view(torch.int16), fake_kv(LAYOUT, n0, s0).view(torch.int16))
                r.complete(h)
                done += 1
        st = r.stats()
        assert done == 200 and (st.verify_ok, st.verify_mismatch, st.transfers_failed) == (200, 0, 0)
        assert st.free_bytes == ARENA and st.quarantined_count == 0
        pst = p.call("stats")
        assert (pst["copies_ok"], pst["sources_released"], pst["offers_open"]) == (200, 200, 0)
    finally:
        r.close()


def test_paused_p_is_chased_with_abort_until_it_answers(xdg: str, children: list[ChildP]) -> None:
    p = ChildP("proc", xdg)
    children.append(p)
    r = receiver()  # the lock proof is on: a stopped P still holds its lock, so it must not fire
    try:
        h = fail_with_copy_blocked(p, r, "until_abort")
        assert p.proc.pid is not None
        os.kill(p.proc.pid, signal.SIGSTOP)
        assert wait_for(lambda: r.poll(h) is TransferState.FAILED, 2.0)
        assert h.region_state is RegionState.QUARANTINED
        sent = r.stats().aborts_sent
        time.sleep(0.6)
        assert h.region_state is RegionState.QUARANTINED and r.stats().aborts_sent >= sent + 5
        os.kill(p.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: h.region_state is RegionState.FREE, 5.0)
        assert h.released_by is ReleaseReason.ABORT_ACK
        r.complete(h)
        assert r.stats().free_bytes == ARENA and p.call("stats")["held_acks"] == 0
    finally:
        r.close()


def test_killed_p_restarted_while_d_is_idle_releases_by_instance_change(
    xdg: str, children: list[ChildP]
) -> None:
    p = ChildP("proc", xdg)
    children.append(p)
    r = receiver(lock_proof=False)
    try:
        h = fail_with_copy_blocked(p, r, "block")
        assert wait_for(lambda: r.poll(h) is TransferState.FAILED, 2.0)
        r.complete(h)
        p.kill()
        time.sleep(0.5)  # five probe periods with P dead: no proof, no release
        assert h.region_state is RegionState.QUARANTINED
        p2 = ChildP("proc", xdg)  # same slot, new instance; D gets no new requests
        children.append(p2)
        assert p2.instance != p.instance
        assert wait_for(lambda: h.region_state is RegionState.FREE, 5.0)
        assert h.released_by is ReleaseReason.INSTANCE_CHANGED
        assert r.stats().free_bytes == ARENA
    finally:
        r.close()


def test_killed_p_not_restarted_held_without_proof_released_by_lock_proof(
    xdg: str, children: list[ChildP]
) -> None:
    p = ChildP("proc", xdg)
    children.append(p)
    strict, with_lock = receiver(lock_proof=False), receiver(lock_proof=True)
    try:
        p.call("hook", "block")
        rs = (strict, with_lock)
        hs = [rr.request(p.offer(16, i), 0.3) for i, rr in enumerate(rs)]
        assert p.call("entered", 5.0)
        assert wait_for(lambda: all(rr.poll(h) is TransferState.FAILED for rr, h in zip(rs, hs, strict=True)))
        p.kill()
        assert wait_for(lambda: hs[1].region_state is RegionState.FREE, 5.0)
        assert hs[1].released_by is ReleaseReason.INSTANCE_GONE
        time.sleep(1.0)  # ten probe periods, ABORTs unanswered: time alone never releases
        assert hs[0].region_state is RegionState.QUARANTINED
        assert strict.held_fraction() > 0 and strict.stats().released_by_gone == 0
    finally:
        strict.close()
        with_lock.close()
