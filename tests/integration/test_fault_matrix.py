"""The fault matrix: real tritonserver, real P and D stub processes, real gRPC clients.

Every row injects one fault into a running 1P1D unit and checks the same four things:
* every transfer is verified: no KV mismatch unless corruption was injected, and then exactly the
  injected ones are detected (and only their streams fail);
* no page leaks: D's free and held pages and P's free pages return to their baseline;
* every affected client hears of it within D's deadline + 1 s;
* unaffected streams finish with the right number of rows.

One unit serves every row (a server start costs ~15 s of the suite's budget); faults are switched on
the running P through its control file, P's engine worker is paused/killed with signals, and its stub
starts a new worker (serving/engine_worker.py; Triton 2.51 itself restarts no dead decoupled stub).

The engine rows (`test_stall_engine_*`, `test_kill_engine_*`) stop or kill each
engine's worker — P, D, the monolithic engine — under arriving traffic and check that the server stays
up and ready, the models that did not need that engine keep serving, the affected clients hear
`[UNAVAILABLE] <model>: engine ...` within the stall bound + 1 s, nothing leaks and `tts` equals
`tts_mono` afterwards. They run once, on the first path of `TANDEM_FAULT_PATHS` (whose unit also serves
`tts_mono`): how an engine is supervised does not depend on the KV path. The stub-stop row
(`test_stub_stop_1s_is_survived_or_the_unit_restarts_the_server`) runs on a unit of its own under
`tandem-unit`: Triton 2.51 may abort on it (a loaded machine), which the shared unit would not survive.
D runs with a 1 MiB receive arena (region mode) and a 128-page pool (direct mode: the pool is the arena)
so that a few quarantined transfers exceed the 25 % drain limit.

The last test prints the matrix (`-s`) and, with TANDEM_FAULT_MATRIX_OUT set, writes it as JSON.
`TANDEM_FAULT_VOLUME` sets the size of the volume row (default 10000 short streams).

The matrix runs once per KV path in `TANDEM_FAULT_PATHS` (default `host_shm,host_shm/region,tcp`, one
unit each: host_shm in direct mode, where P writes D's pool pages, and in region mode, where P copies
into D's receive arena as tcp and the proxy do; their volume rows are `TANDEM_FAULT_VOLUME_REGION` and
`TANDEM_FAULT_VOLUME_TCP`, default 1000 each). The GPU paths `cuda_ipc`,
`cuda_vmm` and `proxy` need `TANDEM_FAULT_GPUS=P,D` (e.g. `0,1`) and run on the device through
`bench/device/run_fault_matrix.sh`; `proxy` also starts the unit's `tandem-proxy` sidecar. Rows about
quarantine, draining and held ACKs are skipped on a path where D itself writes every byte (`tcp`):
there D frees a failed region at once and sends no ABORT, so nothing is held; the tcp-only row shows
the late chunks being dropped instead. The tcp unit runs the cross-host form: P's control plane on a
TCP port too (`tandem.transfer.control=tcp`), on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tandem.backend.settings import BatchSettings
from tandem.gateway.client import StreamResult, TTSClient, build_inputs, next_stream_id
from tandem.serving import process_tree
from tandem.serving.repository import gpu_group
from tests.support.faults import (
    Background,
    FaultUnit,
    Row,
    Snapshot,
    arrivals,
    engine_restarts,
    find_stub,
    find_worker,
    format_matrix,
    process_state,
    server_ready,
    streams,
    volume,
)
from tests.support.helpers import TINY_W, decode, handoff, metric_value, metrics_text, prompt
from tests.support.server import TritonProcess

DEADLINE_S = 2.0
ERROR_BOUND_S = DEADLINE_S + 1.0
STALL_S = 2.0  # tandem.worker.stall_timeout_s: a stalled engine's requests fail after this
STALL_BOUND_S = STALL_S + 1.0
RATE_FLOOR = BatchSettings().rate_floor_tok_s  # 42 tok/s: the tiny repository's rows_per_second / 0.5
VOLUMES = {
    "tcp": int(os.environ.get("TANDEM_FAULT_VOLUME_TCP", "1000")),
    "host_shm/region": int(os.environ.get("TANDEM_FAULT_VOLUME_REGION", "1000")),
    "*": int(os.environ.get("TANDEM_FAULT_VOLUME", "10000")),
}
# Set TANDEM_FAULT_MATRIX_OUT=docs/benchmarks to record a run (fault-matrix-<path>-<cpu|gpu>.json);
# CI leaves the tree alone.
OUT = Path(os.environ["TANDEM_FAULT_MATRIX_OUT"]) if os.environ.get("TANDEM_FAULT_MATRIX_OUT") else None
REPO = Path(__file__).resolve().parents[2]

# A path name, or "<path>/region": that path with tandem.transfer.direct_write=false (P copies into a
# receive region, D scatters), the mode tcp and the proxy use; plain host_shm, cuda_ipc and cuda_vmm
# run in direct mode (P writes D's pool pages).
PATHS = [
    p.strip()
    for p in os.environ.get("TANDEM_FAULT_PATHS", "host_shm,host_shm/region,tcp").split(",")
    if p.strip()
]
GPUS = [int(g) for g in os.environ.get("TANDEM_FAULT_GPUS", "").split(",") if g.strip()]
GROUPS = (
    {"prefill": gpu_group(GPUS[:1]), "decode": gpu_group(GPUS[1:2]), "tts_mono": gpu_group(GPUS[1:2])}
    if GPUS
    else None
)
ENGINES = ("prefill", "decode", "tts_mono")
RECEIVER_WRITES = {"tcp"}  # paths where D writes every byte itself (TransferPath.receiver_writes)


def p_writes_only(unit: FaultUnit) -> None:
    if unit.path in RECEIVER_WRITES:
        pytest.skip(f"{unit.path}: D writes every byte itself, frees a failed region at once, sends no ABORT")


OVERRIDES = {
    "prefill": {
        "tandem.transfer.max_held_acks": "3",
        "tandem.transfer.ticket_ttl_s": "10",
        "tandem.worker.stall_timeout_s": str(STALL_S),
    },
    "tts_mono": {"tandem.worker.stall_timeout_s": str(STALL_S)},
    # The matrix tests transfer failure, not admission: on a 2-core CI box P's forwards take D's cores,
    # the step-time model then (rightly) refuses a second stream, and a row that needs three copies in
    # flight would measure the machine instead of the protocol. Rate admission has its own tests.
    "decode": {
        "tandem.batch.rate_admission": "false",
        "tandem.transfer.deadline_s": str(DEADLINE_S),
        "tandem.transfer.arena_mb": "1",
        # Direct mode (host_shm, cuda_ipc, cuda_vmm): the arena is D's pool, so the pool is what a few
        # held transfers must fill past 25 %: 128 pages of 16 (the largest row needs 96 at once).
        "tandem.pool.num_pages": "128",
        "tandem.transfer.abort_retry_s": "0.2",
        "tandem.transfer.probe_interval_s": "0.5",
        "tandem.worker.stall_timeout_s": str(STALL_S),
    },
}


@pytest.fixture(scope="module", params=PATHS)
def unit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultUnit]:
    label = str(request.param)
    path, _, mode = label.partition("/")
    if mode not in ("", "region"):
        raise ValueError(f"TANDEM_FAULT_PATHS entries are PATH or PATH/region, got {label!r}")
    if len(GPUS) not in (0, 2):
        raise ValueError(f"TANDEM_FAULT_GPUS must name two GPUs (P,D), got {GPUS}")
    overrides = {m: dict(v) for m, v in OVERRIDES.items()}
    if label != PATHS[0]:
        del overrides["tts_mono"]
    for model in ("prefill", "decode"):
        overrides[model].update({"tandem.transfer.paths": path, "tandem.transfer.require_path": path})
        if path == "tcp":  # the cross-host form: P's control plane on TCP too, unit-secret handshakes
            overrides[model]["tandem.transfer.control"] = "tcp"
        if mode == "region":
            overrides[model]["tandem.transfer.direct_write"] = "false"
    if GPUS:  # capture D's graphs at start, not under the first row's streams
        for model in ("decode", "tts_mono"):
            if model in overrides:
                overrides[model]["tandem.batch.graph_warmup_context"] = "512"
    workdir = tmp_path_factory.mktemp(f"faultunit-{path}-{mode or 'default'}")
    u = FaultUnit(workdir, overrides, GROUPS, proxy=path == "proxy", mono=label == PATHS[0])
    u.label = label
    u.start()  # on a GPU the engines compile their kernels before they report ready (model/warm_up.py)
    yield u
    u.stop()


@pytest.fixture
def row(unit: FaultUnit) -> Iterator[tuple[FaultUnit, Snapshot]]:
    """Each row starts from a settled unit (its baseline) and leaves one behind: faults off, P running.

    The baseline is the idle unit's, taken once: a row that left pages out must not pass it on as the
    next row's normal."""
    unit.clear_faults()
    if unit.idle is None:
        unit.wait_for(lambda s: s.p_free_pages > 0 and s.d_free_pages > 0, 30, "P and D publish")
        unit.idle = unit.settle(unit.snapshot())
    base = unit.settle(unit.idle)
    idle_p = unit.idle.p_free_pages
    # P's pages of offers nobody pulled (an earlier row's D stalled or died) return at their TTL.
    base = unit.wait_for(lambda s: s.p_free_pages >= idle_p > 0, 20, "P's pages back to idle")
    yield unit, base
    unit.clear_faults()
    for model in ENGINES if unit.mono else ENGINES[:2]:
        for pid in (find_stub(unit.server_pid, model), find_worker(unit.server_pid, model)):
            if pid is not None and process_state(pid) == "T":
                os.kill(pid, signal.SIGCONT)
        unit.wait_engine(model, True, 90)


def jobs(n: int, rows: int, max_tokens: int, seed: int) -> list[tuple[np.ndarray, dict]]:
    return [(prompt(rows + 7 * i, seed=seed * 1000 + i), {"MAX_TOKENS": max_tokens}) for i in range(n)]


def error_latency(results: list[StreamResult]) -> float:
    lat = [(r.done_ns - r.sent_ns) / 1e9 for r in results if r.error is not None and r.done_ns]
    return max(lat, default=0.0)


def finish(
    unit: FaultUnit,
    base: Snapshot,
    name: str,
    t0: float,
    results: list[StreamResult],
    max_tokens: int | list[int],
    *,
    injected: int = 0,
    proofs: set[str] | None = None,
    **notes: object,
) -> Row:
    """Checks common to every row, then records it: settle, no leak, errors prompt, others complete.
    `proofs`: the proofs that may free this row's failed regions (at least one must have)."""
    # P's pages of an offer nobody pulled (D stalled or dead) come back at the ticket's TTL (10 s).
    end = unit.settle(base, timeout_s=35, p_pages=True)
    wants = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(results)
    failed = [r for r in results if r.error is not None]
    for r, want in zip(results, wants, strict=True):
        if r.error is None:
            assert r.rows is not None and r.rows.shape == (want, TINY_W), (name, r.rows)
    late = [r for r in failed if r.done_ns and (r.done_ns - r.sent_ns) / 1e9 > ERROR_BOUND_S]
    assert not late, (
        f"{name}: errors later than {ERROR_BOUND_S} s: {[(r.error, r.done_ns - r.sent_ns) for r in late]}"
    )
    assert all(r.done_ns for r in failed), f"{name}: a stream never heard of its failure"
    mismatches = int(end.verified_mismatch - base.verified_mismatch)
    assert mismatches == injected, f"{name}: {mismatches} mismatches, {injected} injected"
    rec = Row(
        row=name,
        transfers_verified=int(end.verified_ok - base.verified_ok),
        streams=len(results),
        failed_streams=len(failed),
        mismatches=mismatches,
        corrupted_injected=injected,
        released_by=end.released_since(base),
        leaked_d_pages=int(base.d_free_pages - end.d_free_pages),
        leaked_p_pages=int(base.p_free_pages - end.p_free_pages),
        held_pages_after=int(end.d_held_pages),
        max_error_latency_s=round(error_latency(results), 3),
        seconds=round(time.monotonic() - t0, 1),
        notes=dict(notes),
    )
    assert rec.leaked_d_pages == 0 and rec.leaked_p_pages == 0 and rec.held_pages_after == 0, rec
    if proofs is not None:
        assert rec.released_by and set(rec.released_by) <= proofs, (name, rec.released_by, proofs)
    unit.rows.append(rec)
    return rec


# ---- rows ------------------------------------------------------------------------------------------


def test_pause_p_then_resume_releases_by_p_answer(row):
    """SIGSTOP P while a delayed copy is crossing, past D's deadline, then SIGCONT. The stream whose
    transfer was in flight errors at D's deadline; its region stays held for the whole pause (time is
    never a proof) and returns only after P resumes and answers D's re-sent ABORT — the same P
    process, so neither an instance change nor a free lock can have been the proof: D never reuses a
    region because time passed while a paused P could still write it."""
    unit, base = row
    p_writes_only(unit)
    t0 = time.monotonic()
    # Three streams, the 3rd copy delayed: P is stopped once the first two are verified, so the delayed
    # copy is the only one that can be mid-flight and P holds exactly one ACK, below its limit of 3 (with
    # more streams a copy caught mid-flight by SIGSTOP on a busy machine makes P exit, correctly).
    unit.set_faults(delay_every=3, delay_s=1.5)
    load = Background(lambda: streams(unit.url, jobs(3, 100, 30, seed=1), timeout_s=40))
    unit.wait_for(lambda s: s.verified_ok >= base.verified_ok + 2, 10, "first transfers verified")
    pid = unit.signal_worker("prefill", signal.SIGSTOP)
    time.sleep(DEADLINE_S + 1.0)
    during = unit.snapshot()
    assert during.d_held_pages > 0, "no quarantine while P is stopped"
    time.sleep(1.0)  # still held: nothing but P's answer may free it
    assert unit.snapshot().d_held_pages == during.d_held_pages
    os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    unit.wait_for(lambda s: s.d_held_pages == 0, 10, "held pages back after resume")
    release_s = time.monotonic() - resumed
    results = load.join(40)
    assert find_worker(unit.server_pid, "prefill") == pid, "P must be the same process"
    assert any(r.error is not None for r in results)
    for r in results:
        assert r.error is None or "KV transfer" in r.error, r.error
    finish(
        unit,
        base,
        "pause P (SIGSTOP 4 s) + resume",
        t0,
        results,
        30,
        proofs={"abort_ack", "done"},  # P's own answer: not a restart, not the lock
        held_pages_during_pause=during.d_held_pages,
        release_after_resume_s=round(release_s, 2),
    )


def wait_new_worker(unit: FaultUnit, model: str, old: int, timeout_s: float = 90) -> tuple[int, float]:
    """The worker the stub started after `old` died, once it serves; (pid, seconds it took)."""
    t0 = time.monotonic()
    while True:
        pid = find_worker(unit.server_pid, model)
        if pid not in (None, old):
            break
        assert time.monotonic() - t0 < timeout_s, f"{model}: no new engine worker within {timeout_s} s"
        time.sleep(0.05)
    unit.wait_engine(model, True, max(1.0, timeout_s - (time.monotonic() - t0)))
    return pid, time.monotonic() - t0


def test_kill_p_while_d_drains_then_restart(row):
    """D drains (held > 25 % of its arena) behind a stopped P, with no new traffic; P is then killed. D's
    probing alone must notice (the slot's instance lock is free) and release everything, with no
    request arriving to reveal the dead P. P's stub starts a new worker by itself (Triton 2.51 would
    restart no dead decoupled stub; the stub never died): requests fail with a clear UNAVAILABLE
    meanwhile, and D accepts the new P's new instance id."""
    unit, base = row
    p_writes_only(unit)
    t0 = time.monotonic()
    before = json.loads(handoff(unit.url))["ticket"]["instance_id"]
    restarts = engine_restarts(unit.metrics_url, "prefill")
    unit.set_faults(delay_every=1, delay_s=3.0)
    load = Background(lambda: streams(unit.url, jobs(3, 250, 20, seed=2), timeout_s=40))
    unit.wait_for(lambda s: s.inflight >= 3, 10, "3 transfers in flight")
    pid = unit.signal_worker("prefill", signal.SIGSTOP)
    queued = Background(lambda: streams(unit.url, jobs(2, 30, 5, seed=3), timeout_s=30))
    drain = unit.wait_for(lambda s: s.draining == 1, DEADLINE_S + 2, "D drains")
    assert drain.admittable == 0 and drain.d_held_pages > 0
    time.sleep(1.0)
    assert unit.snapshot().draining == 1, "time alone released held pages"
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    unit.wait_for(lambda s: s.draining == 0 and s.d_held_pages == 0, 10, "dead P discovered")
    discover_s = time.monotonic() - killed
    results = load.join(40) + queued.join(40)
    assert all(r.error is not None for r in results), [r.error for r in results]
    unit.clear_faults()
    after_kill = streams(unit.url, jobs(1, 20, 3, seed=4))
    assert after_kill[0].error is None or "[UNAVAILABLE] prefill: engine" in after_kill[0].error, after_kill
    _, restart_s = wait_new_worker(unit, "prefill", pid)
    assert find_stub(unit.server_pid, "prefill") is not None, "P's stub died with its worker"
    assert engine_restarts(unit.metrics_url, "prefill") == restarts + 1
    text = handoff(unit.url)
    after = json.loads(text)["ticket"]["instance_id"]
    assert after != before
    out, err = decode(unit.url, text)
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8
    ok = streams(unit.url, jobs(4, 40, 10, seed=5))
    assert all(r.error is None for r in ok), [r.error for r in ok]
    finish(
        unit,
        base,
        "kill P (draining D, no traffic)",
        t0,
        results + after_kill + ok,
        [20] * 3 + [5] * 2 + [3] + [10] * 4,
        proofs={"instance_gone"},
        held_pages_while_draining=drain.d_held_pages,
        dead_p_discovered_s=round(discover_s, 2),
        restarted_by="prefill's stub",
        restart_s=round(restart_s, 1),
        new_instance_accepted=True,
    )


def test_three_held_acks_make_p_exit(row):
    """Every copy stalls past D's deadline: D aborts, P cannot prove the copies over and holds 3 ACKs,
    so P's worker exits (os._exit(70)). Its death frees the slot lock — D's proof — and the new worker
    its stub starts (a new instance) serves again."""
    unit, base = row
    p_writes_only(unit)
    t0 = time.monotonic()
    unit.set_faults(delay_every=1, delay_s=8.0)
    pid = unit.worker("prefill")
    results = streams(unit.url, jobs(4, 60, 10, seed=6), timeout_s=20)
    assert all(r.error is not None and "KV transfer" in r.error for r in results), [r.error for r in results]
    deadline = time.monotonic() + 5
    while process_state(pid) not in ("", "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_state(pid) in ("", "Z"), "P did not exit with 3 held ACKs"
    log = unit.proc.log_path.read_text(errors="replace")
    exit_logged = "prefill exits so that its restart proves" in log
    unit.wait_for(lambda s: s.d_held_pages == 0, 10, "held pages released after P's exit")
    unit.clear_faults()
    _, restart_s = wait_new_worker(unit, "prefill", pid)
    assert "exited for proof" in unit.proc.log_path.read_text(errors="replace")
    ok = streams(unit.url, jobs(4, 40, 10, seed=7))
    assert all(r.error is None for r in ok), [r.error for r in ok]
    # The three held copies' regions come back by P's death; a fourth copy that had not started when
    # D aborted it (P prefills the four prompts together, so all four PULLs can queue at once) is
    # rightly ACKed at once: "never started" is proof too.
    released = unit.snapshot().released_since(base)
    assert released.get("instance_gone", 0) + released.get("instance_changed", 0) >= 3, released
    finish(
        unit,
        base,
        "3 held ACKs -> P exits",
        t0,
        results + ok,
        10,
        proofs={"instance_gone", "instance_changed", "abort_ack"},
        p_exit_logged=exit_logged,
        restart_s=round(restart_s, 1),
    )


def test_pause_proxy_then_resume_releases_by_p_answer(row):
    """Proxy path only (device): the sidecar is SIGSTOPped before a stream starts, so P's copy blocks
    inside the proxy past D's deadline. The stream errors at the deadline; its region stays held for
    the whole pause (P cannot prove the copy over, and P's lock is no proof while P lives); after
    SIGCONT the proxy finishes the copy, P answers D's ABORT, and that answer frees the region.
    Written for the GPU matrix (bench/device/run_fault_matrix.sh); not yet run on the device."""
    unit, base = row
    if unit.path != "proxy":
        pytest.skip(f"{unit.path}: no proxy sidecar in this unit")
    t0 = time.monotonic()
    pid = unit.signal_proxy(signal.SIGSTOP)
    try:
        load = Background(lambda: streams(unit.url, jobs(1, 80, 20, seed=50), timeout_s=30))
        time.sleep(DEADLINE_S + 1.0)
        during = unit.snapshot()
        assert during.d_held_pages > 0, "no quarantine while the proxy is stopped"
        time.sleep(1.0)
        assert unit.snapshot().d_held_pages == during.d_held_pages, "time alone released held pages"
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    unit.wait_for(lambda s: s.d_held_pages == 0, 10, "held pages back after the proxy resumed")
    results = load.join(30)
    assert all(r.error is not None and "KV transfer" in r.error for r in results), [r.error for r in results]
    finish(
        unit,
        base,
        "pause proxy (SIGSTOP 4 s) + resume",
        t0,
        results,
        20,
        proofs={"abort_ack", "done"},
        held_pages_during_pause=during.d_held_pages,
        release_after_resume_s=round(time.monotonic() - resumed, 2),
    )


def test_deadline_expiry_fails_only_delayed_streams(row):
    unit, base = row
    t0 = time.monotonic()
    unit.set_faults(delay_every=4, delay_s=3.0)  # copies 4 and 8: two held ACKs at most
    results = streams(unit.url, jobs(8, 50, 40, seed=8), timeout_s=30)
    failed = [r for r in results if r.error is not None]
    assert len(failed) == 2 and all("no DONE within the deadline" in str(r.error) for r in failed), failed
    rates = [r.tokens_per_s for r in results if r.error is None]
    late = {"receiver_drops"} if unit.path in RECEIVER_WRITES else {"abort_ack", "done"}
    finish(
        unit,
        base,
        "deadline expiry (2 of 8 delayed)",
        t0,
        results,
        40,
        proofs=late,
        min_rate_ok_tok_s=round(min(rates)),
    )


def _late_chunks_dropped(unit: FaultUnit) -> float:
    try:
        return metric_value(metrics_text(unit.metrics_url), "tandem_kv_late_chunks_dropped_total")
    except KeyError:  # no chunk dropped yet: the counter has no sample
        return 0.0


def test_late_copy_is_dropped_by_d_without_quarantine(row):
    """Protocol v3 (tcp): copies 3 and 6 start after D's deadline. D fails those streams at the
    deadline and frees their regions at once (nothing is ever held: D writes every byte itself and
    has stopped expecting them); the late chunks reach D and are dropped, counted, never written."""
    unit, base = row
    if unit.path not in RECEIVER_WRITES:
        pytest.skip(f"{unit.path}: P writes D's memory; the pause, kill and held-ACK rows cover it")
    text = handoff(unit.url)
    endpoint = json.loads(text)["ticket"]["endpoint"]
    assert endpoint.startswith("tcp://127.0.0.1:"), f"the tcp unit's control plane is not on TCP: {endpoint}"
    out, err = decode(unit.url, text)
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8
    t0 = time.monotonic()
    dropped_before = _late_chunks_dropped(unit)
    unit.set_faults(delay_every=3, delay_s=DEADLINE_S + 1.0)
    load = Background(lambda: streams(unit.url, jobs(6, 60, 20, seed=40), timeout_s=30))
    held = []
    while load.running():
        held.append(unit.snapshot().d_held_pages)
        time.sleep(0.1)
    results = load.join(30)
    failed = [r for r in results if r.error is not None]
    assert len(failed) == 2 and all("no DONE within the deadline" in str(r.error) for r in failed), failed
    assert max(held) == 0, "a receiver-writes path must not quarantine"
    deadline = time.monotonic() + 5
    while _late_chunks_dropped(unit) == dropped_before and time.monotonic() < deadline:
        time.sleep(0.1)
    dropped = _late_chunks_dropped(unit) - dropped_before
    assert dropped > 0, "the late copies' chunks were not seen and dropped by D"
    finish(
        unit,
        base,
        "late copy dropped (tcp, 2 of 6)",
        t0,
        results,
        20,
        proofs={"receiver_drops"},
        late_chunks_dropped=int(dropped),
    )


def test_corruption_is_detected_and_fails_only_its_streams(row):
    unit, base = row
    t0 = time.monotonic()
    unit.set_faults(corrupt_every=3)
    results: list[StreamResult] = []
    for batch in range(3):  # sequential batches: the copy counter decides, every 3rd is corrupted
        results += streams(unit.url, jobs(6, 30, 6, seed=9 + batch), timeout_s=30)
    failed = [r for r in results if r.error is not None]
    assert len(failed) == 6 and all("hashes to" in str(r.error) for r in failed), [r.error for r in failed]
    finish(unit, base, "corruption (every 3rd copy)", t0, results, 6, injected=6, proofs={"done"})


def test_client_cancel_mid_stream_returns_pages(row):
    """Three clients hang up mid-stream. Triton 2.51 checks cancellation only between ensemble steps,
    so `decode` (already running the stream) is not told: it decodes to MAX_TOKENS into a closed
    stream and frees the pages at the end. Asserted: the pages come back and the others finish; the
    row records whether decode saw the cancellation and how long the pages took."""
    unit, base = row
    t0 = time.monotonic()
    cancelled_before = decode_cancelled(unit)
    cancelled = [TTSClient(unit.url, "tts") for _ in range(3)]
    for i, c in enumerate(cancelled):
        c.send(prompt(150, seed=20 + i), MAX_TOKENS=600)
    others = Background(lambda: streams(unit.url, jobs(3, 40, 100, seed=21), timeout_s=40))
    unit.wait_for(lambda s: s.inflight >= 3, 10, "long streams decoding")
    time.sleep(0.3)
    for c in cancelled:
        c.close(cancel=True)
    hung_up = time.monotonic()
    results = others.join(40)
    assert all(r.error is None for r in results), [r.error for r in results]
    unit.settle(base, timeout_s=30)
    pages_back_s = time.monotonic() - hung_up
    finish(
        unit,
        base,
        "client cancel mid-stream (3 of 6)",
        t0,
        results,
        100,
        cancelled_streams=3,
        decode_saw_cancel=decode_cancelled(unit) - cancelled_before,
        pages_back_after_hangup_s=round(pages_back_s, 1),
    )


def decode_cancelled(unit: FaultUnit) -> int:
    try:
        text = metrics_text(unit.metrics_url)
        return int(metric_value(text, "tandem_streams_total", model="decode", outcome="cancelled"))
    except KeyError:
        return 0


def slow_stream(url: str, x: np.ndarray, max_tokens: int, sleep_s: float) -> dict[str, object]:
    """A client whose callback sleeps `sleep_s` per response (it reads slowly)."""
    done: queue.Queue[str | None] = queue.Queue()
    rows = [0]
    t0 = time.monotonic()

    def cb(result=None, error=None) -> None:
        time.sleep(sleep_s)
        if error is not None:
            done.put(str(error))
            return
        tokens = result.as_numpy("TOKENS")
        if tokens is not None:
            rows[0] += tokens.shape[0]
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.put(None)

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=cb)
    sid = next_stream_id()
    client.async_stream_infer(
        "tts",
        build_inputs(x, MAX_TOKENS=max_tokens),
        sequence_id=sid,
        sequence_start=True,
        sequence_end=True,
        enable_empty_final_response=True,
    )
    err = done.get(timeout=60)
    client.stop_stream()
    client.close()
    return {"error": err, "rows": rows[0], "seconds": time.monotonic() - t0}


def test_slow_consumer_and_many_streams(row):
    unit, base = row
    t0 = time.monotonic()
    slow = Background(lambda: slow_stream(unit.url, prompt(80, seed=30), 300, 0.25))
    results = streams(unit.url, jobs(16, 30, 60, seed=31), timeout_s=40)
    s = slow.join(60)
    assert s["error"] is None and s["rows"] == 300, s
    assert all(r.error is None for r in results), [r.error for r in results]
    rates = [r.tokens_per_s for r in results]
    assert min(rates) >= RATE_FLOOR, rates  # the slow reader does not slow the others below the floor
    finish(
        unit,
        base,
        "slow consumer + 16 streams",
        t0,
        results,
        60,
        slow_reader_s=round(float(s["seconds"]), 1),  # type: ignore[arg-type]
        min_rate_others_tok_s=round(min(rates)),
    )


def test_duplicate_handoff_concurrently(row):
    """A HANDOFF replayed to `decode` twice at once: one stream decodes, the other is refused (P
    serves one PULL per offer; D refuses a transfer id it already requested)."""
    unit, base = row
    t0 = time.monotonic()
    pairs = 0
    for _ in range(5):
        text = handoff(unit.url)
        a = Background(lambda t=text: decode(unit.url, t))
        b = Background(lambda t=text: decode(unit.url, t))
        outs = [a.join(30), b.join(30)]
        good = [o for o, e in outs if e is None]
        bad = [e for _, e in outs if e is not None]
        assert len(good) == 1 and len(bad) == 1 and "KV transfer" in bad[0], outs
        assert sum(o["TOKENS"].shape[0] for o in good[0]) == 8
        pairs += 1
    rec = finish(unit, base, "duplicate HANDOFF (concurrent)", t0, [], [], replayed_pairs=pairs)
    rec.streams, rec.failed_streams = 2 * pairs, pairs  # one of each pair refused, by design


def _volume(unit: FaultUnit) -> int:
    return VOLUMES.get(unit.label, VOLUMES["*"])


def test_volume(row):
    unit, base = row
    n = _volume(unit)
    t0 = time.monotonic()
    ok, errors = volume(unit.url, n, n_clients=8)
    assert not errors, errors[:5]
    assert ok == n
    rec = finish(unit, base, f"volume ({n} short streams, 8 clients)", t0, [], [])
    rec.streams = n
    assert rec.transfers_verified == n


# ---- engine rows: P, D and the monolithic engine stalled or killed under traffic -----------------

# Who sends traffic to an engine: tts reaches P and D, tts_mono the monolithic engine.
ENTRY = {"prefill": "tts", "decode": "tts", "tts_mono": "tts_mono"}
STALL_FOR_S = 5.0


def engine_rows_here(unit: FaultUnit) -> None:
    if not unit.mono:
        pytest.skip("the engine rows run once, on the first path's unit (the one serving tts_mono)")


def tts_equals_mono(url: str, seed: int) -> None:
    """The same greedy requests through `tts` and `tts_mono` give the same tokens."""
    same = jobs(3, 30, 12, seed=seed)
    for j in same:
        j[1]["TEMPERATURE"] = 0.0
    pd, mono = streams(url, same), streams(url, same, model="tts_mono")
    for a, b in zip(pd, mono, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.rows is not None and b.rows is not None and np.array_equal(a.rows, b.rows)


def bystanders(unit: FaultUnit, model: str, seed: int) -> list[tuple[str, Background]]:
    """Long streams that never need `model`'s engine, started (and, on D, decoding) before the fault:
    tts_mono while P or D fails; tts streams already on D while P or the monolithic engine fails."""
    out = []
    if model != "tts_mono":
        out.append(
            (
                "tts_mono",
                Background(
                    lambda: streams(unit.url, jobs(2, 40, 400, seed=seed), timeout_s=60, model="tts_mono")
                ),
            )
        )
    if model != "decode":
        verified = unit.snapshot().verified_ok
        out.append(("tts", Background(lambda: streams(unit.url, jobs(2, 40, 400, seed=seed + 1), 60))))
        unit.wait_for(lambda s: s.verified_ok >= verified + 2, 20, "bystander tts streams on D")
    return out


def victims(unit: FaultUnit, model: str, seed: int, rows: int = 400) -> Background | None:
    """Long streams in flight on `model`'s engine when the fault comes (D and the monolithic engine;
    P holds a request only for its forward)."""
    if model == "prefill":
        return None
    before = unit.snapshot().verified_ok
    load = Background(lambda: streams(unit.url, jobs(2, 40, rows, seed=seed), 60, model=ENTRY[model]))
    if model == "decode":
        unit.wait_for(lambda s: s.verified_ok >= before + 2, 20, "victim streams on D")
    else:
        deadline = time.monotonic() + 20
        while metric_value(metrics_text(unit.metrics_url), "tandem_inflight_streams", model=model) < 2:
            assert time.monotonic() < deadline, "victim streams never ran on tts_mono"
            time.sleep(0.05)
    time.sleep(0.3)  # a few chunks out: mid-stream
    return load


def told_after(results: list[StreamResult], at_ns: int) -> float:
    """The latest error, in seconds after `at_ns` (the fault) or after the stream was sent."""
    lat = [(r.done_ns - max(at_ns, r.sent_ns)) / 1e9 for r in results if r.error is not None]
    return max(lat, default=0.0)


def check_bystanders(kept: list[tuple[str, Background]]) -> dict[str, float]:
    rates = {}
    for name, bg in kept:
        res = bg.join(90)
        assert all(r.error is None for r in res), (name, [r.error for r in res])
        assert all(r.rows is not None and r.rows.shape == (400, TINY_W) for r in res), name
        rates[name] = round(min(r.tokens_per_s for r in res))
        # a fault in another engine does not slow these below the rate floor (real time over RTF 0.5)
        assert rates[name] >= RATE_FLOOR, f"{name} bystanders: {rates[name]} tok/s, floor {RATE_FLOOR:g}"
    return rates


@pytest.mark.parametrize("model", ENGINES)
def test_stall_engine_under_traffic_then_resume(row, model):
    """SIGSTOP `model`'s engine worker for 5 s while requests keep arriving, then SIGCONT. Its stub
    keeps answering: the engine's streams and every request that arrives fail with `[UNAVAILABLE]
    <model>: engine not responding` within the stall bound + 1 s; `tandem_engine_up` reads 0; the
    server and every model stay ready; the other models' streams stream on. On SIGCONT the same worker
    serves again (no restart), it drops what the stub failed, and nothing leaks."""
    unit, base = row
    engine_rows_here(unit)
    t0 = time.monotonic()
    restarts = engine_restarts(unit.metrics_url, model)
    kept = bystanders(unit, model, seed=60)
    hit = victims(unit, model, seed=62)
    pid = unit.signal_worker(model, signal.SIGSTOP)
    stopped_ns = time.time_ns()
    traffic = arrivals(unit.url, ENTRY[model], n=10, every_s=0.5, seed=64)
    try:
        down_s = unit.wait_engine(model, False, STALL_BOUND_S)
        ready_during = server_ready(unit.url, (*ENGINES, "tts"))
        time.sleep(max(0.0, STALL_FOR_S - (time.time_ns() - stopped_ns) / 1e9))
    finally:
        os.kill(pid, signal.SIGCONT)
    back_s = unit.wait_engine(model, True, 10)
    arrived = traffic.join(90)
    hit_results = hit.join(90) if hit is not None else []
    assert ready_during and server_ready(unit.url, (*ENGINES, "tts")), "Triton reported not ready"
    assert find_worker(unit.server_pid, model) == pid, "the stalled worker was replaced"
    assert engine_restarts(unit.metrics_url, model) == restarts
    says = f"[UNAVAILABLE] {model}: engine not responding"
    for r in hit_results:
        assert r.error is not None and says in r.error, r.error
    failed = [r for r in arrived if r.error is not None]
    assert failed, "no arrival met the stalled engine"
    for r in failed:
        assert says in r.error, r.error
    told = max(told_after(hit_results, stopped_ns), told_after(arrived, stopped_ns))
    assert told <= STALL_BOUND_S, f"a client was told {told:.2f} s after the stall began"
    rates = check_bystanders(kept)
    tts_equals_mono(unit.url, seed=66)
    finish(
        unit,
        base,
        f"stall {model} 5 s + resume",
        t0,
        arrived,
        5,
        stalled_streams_failed=len(hit_results),
        arrivals_failed=len(failed),
        arrivals_served=len(arrived) - len(failed),
        clients_told_within_s=round(told, 2),
        engine_down_published_s=round(down_s, 2),
        engine_up_after_resume_s=round(back_s, 2),
        bystander_min_rate_tok_s=rates,
        tts_equals_mono_after=True,
    )


@pytest.mark.parametrize("model", ENGINES)
def test_kill_engine_mid_stream(row, model):
    """SIGKILL `model`'s engine worker mid-stream under arriving traffic. Its stub sees the channel
    end at once: the engine's streams fail with `[UNAVAILABLE] <model>: engine died ...` within 1 s,
    arrivals fail with a clear UNAVAILABLE until the new worker (started by the stub with backoff,
    counted in `tandem_engine_restarts_total`) serves; a new P is a new instance id, which D accepts.
    The server and the other models serve throughout; nothing leaks; tts equals tts_mono after."""
    unit, base = row
    engine_rows_here(unit)
    t0 = time.monotonic()
    restarts = engine_restarts(unit.metrics_url, model)
    before = json.loads(handoff(unit.url))["ticket"]["instance_id"] if model == "prefill" else None
    kept = bystanders(unit, model, seed=70)
    traffic = arrivals(
        unit.url, ENTRY[model], n=12, every_s=0.25, seed=74, rows=400 if model == "prefill" else 20
    )
    if model == "prefill":
        hit = None
        time.sleep(0.6)  # arrivals in flight, in P's forwards
    else:
        # Killed as soon as they are mid-stream (arrivals already flowing): on a GPU the tiny model
        # ends a 400-row stream in under a second. As long as D's 128-page pool allows (two of 840
        # rows and the arrivals' few), and the longest allowed on tts_mono; killed, length costs nothing.
        hit = victims(unit, model, seed=72, rows=800 if model == "decode" else 2048)
    pid = unit.signal_worker(model, signal.SIGKILL)
    killed_ns = time.time_ns()
    ready_during = server_ready(unit.url, (*ENGINES, "tts"))
    new_pid, restart_s = wait_new_worker(unit, model, pid)
    arrived = traffic.join(90)
    hit_results = hit.join(90) if hit is not None else []
    assert ready_during and server_ready(unit.url, (*ENGINES, "tts")), "Triton reported not ready"
    assert engine_restarts(unit.metrics_url, model) == restarts + 1
    for r in hit_results:
        assert r.error is not None and f"[UNAVAILABLE] {model}: engine died" in r.error, r.error
    failed = [r for r in arrived if r.error is not None]
    clear = (f"[UNAVAILABLE] {model}: engine", "KV transfer")  # P's death also fails transfers in flight
    for r in failed:
        assert any(c in r.error for c in clear), r.error
    told = max(told_after(hit_results, killed_ns), told_after(arrived, killed_ns))
    assert told <= ERROR_BOUND_S, f"a client was told {told:.2f} s after the kill"
    if model == "prefill":
        assert json.loads(handoff(unit.url))["ticket"]["instance_id"] != before
    rates = check_bystanders(kept)
    tts_equals_mono(unit.url, seed=76)
    finish(
        unit,
        base,
        f"kill {model} mid-stream",
        t0,
        arrived,
        5,
        killed_streams_failed=len(hit_results),
        arrivals_failed=len(failed),
        arrivals_served=len(arrived) - len(failed),
        clients_told_within_s=round(told, 2),
        new_worker_serves_after_s=round(restart_s, 1),
        new_worker_pid_differs=new_pid != pid,
        bystander_min_rate_tok_s=rates,
        tts_equals_mono_after=True,
    )


def _server_of(unit_pid: int) -> int | None:
    """The tritonserver child of a `tandem-unit`, or None (between a death and its restart)."""
    for pid in process_tree.children(unit_pid):
        argv = process_tree.argv(pid)
        if argv and argv[0].endswith("tritonserver"):
            return pid
    return None


def test_stub_stop_1s_is_survived_or_the_unit_restarts_the_server(tmp_path_factory):
    """A 1 s SIGSTOP of the prefill *stub* (not its worker) under arriving traffic, on a unit of its own
    run as `make serve` runs it (under tandem-unit). Triton 2.51 survives it on an idle machine and, on
    a loaded one, sometimes aborts when the stub resumes (Signal 6, upstream #8882; 1 of 2 runs beside
    four busy loops on 2 cores). Either way the clients are told and the unit serves again: the server
    survives (arrivals that met the stopped stub fail with a clear error, the bystanders finish), or it
    aborts and tandem-unit restarts it at once, every client in flight hears within 2 s (its
    connection breaks) and every model serves again. Which one happened is printed."""
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path_factory.mktemp("stub-stop"), launcher=(str(unit_bin), "--poll-interval", "0.2", "--")
    )
    shutil.rmtree(proc.repo / "voices")  # not used here; saves a start
    started = time.monotonic()
    proc.start()
    load_s = time.monotonic() - started
    try:
        assert proc.proc is not None
        sup = proc.proc.pid
        server = _server_of(sup)
        assert server is not None
        url = proc.url
        for model in ("tts", "tts_mono"):
            r = streams(url, jobs(1, 20, 5, seed=79), 60, model=model)[0]
            assert r.error is None, r.error
        died: list[float] = []

        def watch() -> None:  # when the server died, if it did
            while not died and time.monotonic() - started < 600:
                if not process_tree.alive(server):
                    died.append(time.monotonic())
                time.sleep(0.02)

        watcher = Background(watch)
        kept = Background(lambda: streams(url, jobs(2, 40, 400, seed=80), timeout_s=60, model="tts_mono"))

        def one(i: int) -> tuple[str | None, float]:
            x = np.random.default_rng(82 * 1000 + i).integers(0, 1024, size=(20 + i, 4), dtype=np.int64)
            try:
                with TTSClient(url, "tts") as c:
                    r = c.run(x, timeout_s=60, MAX_TOKENS=5, TEMPERATURE=0.0)
                return r.error, time.monotonic()
            except Exception as exc:  # the connection broke: the server died
                return f"{type(exc).__name__}: {exc}", time.monotonic()

        stub = find_stub(server, "prefill")
        assert stub is not None
        traffic = []
        stopped = float("inf")
        for i in range(8):
            traffic.append(Background(lambda i=i: one(i)))
            time.sleep(0.25)
            if i == 1:  # arrivals already flowing
                os.kill(stub, signal.SIGSTOP)
                stopped = time.monotonic()
        time.sleep(max(0.0, 1.0 - (time.monotonic() - stopped)))
        with contextlib.suppress(ProcessLookupError):
            os.kill(stub, signal.SIGCONT)
        arrived = [t.join(90) for t in traffic]
        bystanders = kept.join(90)
        time.sleep(1.0)  # a death right at the end is seen
        survived = process_tree.alive(server)
        if survived:
            assert not died
            failed = [e for e, _ in arrived if e is not None]
            for e in failed:
                assert "not healthy" in e or "[UNAVAILABLE]" in e, e
            for r in bystanders:
                assert r.error is None and r.rows is not None and r.rows.shape == (400, TINY_W), r.error
            told = 0.0
        else:
            assert died, "the server died unseen"
            log = proc.log_path.read_text(errors="replace")
            assert "): it exited unexpectedly with status -6" in log, proc.log_tail()
            # every client still waiting when the server died was told at once
            told = max((at - died[0] for e, at in arrived if e is not None and at >= died[0]), default=0.0)
            assert told <= 2.0, f"a client heard {told:.1f} s after the abort"
            assert all(e is not None or at < died[0] for e, at in arrived)
        with contextlib.suppress(AssertionError):
            watcher.join(1)
        for model in ("tts", "tts_mono"):  # served again (after a restart: once the new server loaded)
            deadline = time.monotonic() + 60 + 2 * load_s
            while True:
                try:
                    r = streams(url, jobs(1, 20, 5, seed=84), 60, model=model)[0]
                    if r.error is None:
                        break
                except Exception as exc:
                    r = StreamResult(stream_id=0, error=str(exc))
                assert time.monotonic() < deadline, f"{model} not served again: {r.error}\n{proc.log_tail()}"
                time.sleep(0.5)
        print(
            "\nstop prefill stub 1 s (under tandem-unit): "
            + (
                f"survived; {len([e for e, _ in arrived if e])} of {len(arrived)} arrivals failed clearly"
                if survived
                else f"Triton aborted; tandem-unit restarted it, every client told within {told:.2f} s"
            )
        )
    finally:
        proc.stop()


def test_cancel_reaches_the_engine_where_triton_reports_it(row):
    """Two `tts_mono` clients hang up mid-stream. `tts_mono` is a plain decoupled model: Triton 2.51
    reports the cancellation to its response sender, the stub's watchdog forwards it (Cancel) and the
    engine drops the streams and frees their pages before MAX_TOKENS. (Inside the `tts` ensemble 2.51
    does not report it to `decode`: see the client-cancel row's `decode_saw_cancel`.)"""
    unit, base = row
    engine_rows_here(unit)
    t0 = time.monotonic()

    def cancelled() -> float:
        try:
            text = metrics_text(unit.metrics_url)
            return metric_value(text, "tandem_streams_total", model="tts_mono", outcome="cancelled")
        except KeyError:
            return 0.0

    before = cancelled()
    clients = [TTSClient(unit.url, "tts_mono") for _ in range(2)]
    for i, c in enumerate(clients):
        c.send(prompt(60, seed=90 + i), MAX_TOKENS=2000)
    deadline = time.monotonic() + 20
    while metric_value(metrics_text(unit.metrics_url), "tandem_inflight_streams", model="tts_mono") < 2:
        assert time.monotonic() < deadline, "the streams never ran"
        time.sleep(0.05)
    time.sleep(0.3)
    for c in clients:
        c.close(cancel=True)
    hung_up = time.monotonic()
    while cancelled() < before + 2:
        assert time.monotonic() - hung_up < 10, "tts_mono's engine never saw the cancellation"
        time.sleep(0.05)
    seen_s = time.monotonic() - hung_up
    while metric_value(metrics_text(unit.metrics_url), "tandem_inflight_streams", model="tts_mono") > 0:
        assert time.monotonic() - hung_up < 10, "cancelled streams still in flight"
        time.sleep(0.05)
    finish(
        unit,
        base,
        "client cancel reaches tts_mono",
        t0,
        [],
        [],
        cancelled_streams=2,
        engine_saw_cancel_after_s=round(seen_s, 2),
    )


def test_matrix_totals_and_report(unit, request):
    """Runs last for each path: prints the matrix and, with TANDEM_FAULT_MATRIX_OUT set, records it."""
    assert unit.rows, "no row ran"
    print(f"\n{unit.label}:\n" + format_matrix(unit.rows))
    total = sum(r.transfers_verified for r in unit.rows)
    names = {r.row.split(" (")[0] for r in unit.rows}
    where = f"gpu{''.join(map(str, GPUS))}" if GPUS else "cpu"
    whole = not request.config.getoption("keyword") and not request.config.getoption("lf", default=False)
    if OUT is not None and whole:  # the whole matrix ran (not a selection): record it
        out = OUT / f"fault-matrix-{unit.label.replace('/', '-')}-{where}.json"
        commit = os.environ.get("TANDEM_BENCH_COMMIT", "")  # a copied tree's .git may be stale
        try:
            commit = (
                commit
                or subprocess.run(
                    ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, check=False
                ).stdout.strip()
            )
        except OSError:
            commit = ""
        doc = {
            "unit": f"1P1D, tiny preset, {f'P on GPU {GPUS[0]}, D on GPU {GPUS[1]}' if GPUS else 'CPU'}",
            "path": unit.path,
            "mode": "region" if unit.label.endswith("/region") or unit.path in ("tcp", "proxy") else "direct",
            **unit.matrix(),
            "commit": commit,
            "volume": _volume(unit),
            "cpus": os.cpu_count(),
            "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
    assert all(r.leaked_d_pages == 0 and r.leaked_p_pages == 0 for r in unit.rows)
    assert names and total > 0
    if whole and _volume(unit) >= 10_000:  # a selection (-k) may leave the volume row out
        assert total >= 10_000
