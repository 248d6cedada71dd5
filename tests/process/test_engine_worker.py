"""The stub's side of an engine worker without Triton: a real `tandem-engine` process (the monolithic
engine, tiny preset, CPU) behind `EngineWorker`, driven with plain responders.

Checks the contract `serving/engine_worker.py` states: requests are answered through the responder
(Replies then FINAL); a stopped worker's pending and new requests fail `[UNAVAILABLE] tts_mono: engine
not responding` within the stall bound and it serves again on SIGCONT (same process); a killed worker's
requests fail `engine died` at once and a new worker serves, counted as a restart; close() stops it.
Also the channel's framing and the worker's metrics aggregation.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from tandem.backend.errors import TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.settings import WorkerSettings
from tandem.backend.worker.channel import Array, Beat, Cancel, Channel, Reply, Submit
from tandem.backend.worker.metrics import BeatMetrics
from tandem.serving.engine_worker import EngineWorker, WorkerState

STALL_S = 1.0


@dataclass
class Responder:
    rows: list[np.ndarray] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    decoding: threading.Event = field(default_factory=threading.Event)  # its first rows came back
    at: float = 0.0

    def reply(self, reply: Reply) -> None:
        assert reply.rows is not None
        self.rows.append(reply.rows.numpy())
        self.decoding.set()
        if reply.final:
            self.at = time.monotonic()
            self.done.set()

    def fail(self, error: TandemError) -> None:
        self.error = str(error)
        self.at = time.monotonic()
        self.done.set()

    def cancelled(self) -> bool:
        return False


def _args() -> dict[str, object]:
    params = {
        "tandem.model.preset": "tiny",
        "tandem.device": "cpu",
        "tandem.pool.num_pages": "256",
        "tandem.torch_threads": "1",
    }
    config = {"parameters": {k: {"string_value": v} for k, v in params.items()}}
    return {
        "model_name": "tts_mono",
        "model_instance_name": "tts_mono_0_0",
        "model_instance_kind": "CPU",
        "model_instance_device_id": "0",
        "model_config": json.dumps(config),
    }


def _submit(worker: EngineWorker, rows: int, seed: int = 0) -> Responder:
    r = Responder()
    prompt = np.random.default_rng(seed).integers(0, 1024, size=(20, 4), dtype=np.int64)
    worker.submit(
        lambda req_id: Submit(
            req_id=req_id,
            stream_id=seed + 1,
            timings={},
            prompt=Array.of(prompt),
            sampling=SamplingParams(seed=seed).to_wire(),
            max_new_rows=rows,
        ),
        r,
    )
    return r


def _decoding(r: Responder) -> None:
    """`r`'s stream is mid-way: its first rows came back and its last has not (2,000 rows take the
    tiny model seconds on a CPU, so a signal sent now meets it decoding)."""
    assert r.decoding.wait(30), "the stream never started"
    assert not r.done.is_set(), f"the stream ended already: {sum(len(x) for x in r.rows)} rows, {r.error}"


def _worker_pid(worker: EngineWorker) -> int:
    p = worker._proc
    assert p is not None
    return p.proc.pid


@pytest.fixture
def worker():
    health = RecordingMetrics()
    w = EngineWorker(
        _args(),
        "mono",
        WorkerSettings(stall_timeout_s=STALL_S, restart_backoff_s=0.2),
        RecordingMetrics(),
        health,
    )
    w.start()
    yield w, health
    w.close()


@pytest.mark.slow
def test_serves_stalls_resumes_dies_and_restarts(worker):
    w, health = worker
    assert health.get("tandem_engine_up") == 1.0 and health.get("tandem_engine_restarts_total") == 0.0
    r = _submit(w, 8)
    assert r.done.wait(30) and r.error is None and sum(len(x) for x in r.rows) == 8

    pid = _worker_pid(w)
    long = _submit(w, 2000, seed=1)
    _decoding(long)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert long.done.wait(STALL_S + 2), "the stalled engine's stream was not failed"
        assert long.error is not None and "[UNAVAILABLE] tts_mono: engine not responding" in long.error
        assert long.at - stopped <= STALL_S + 1.0
        assert w._state is WorkerState.STALLED and health.get("tandem_engine_up") == 0.0
        refused = _submit(w, 4, seed=2)
        assert refused.done.wait(1) and refused.error is not None and "not responding" in refused.error
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while w._state is not WorkerState.UP:
        assert time.monotonic() < deadline, "the resumed worker did not serve again"
        time.sleep(0.05)
    assert _worker_pid(w) == pid and health.get("tandem_engine_up") == 1.0
    r = _submit(w, 6, seed=3)
    assert r.done.wait(30) and r.error is None and sum(len(x) for x in r.rows) == 6

    doomed = _submit(w, 2000, seed=4)
    _decoding(doomed)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    assert doomed.done.wait(3) and doomed.error is not None, "the dead engine's stream was not failed"
    assert "[UNAVAILABLE] tts_mono: engine died" in doomed.error and doomed.at - killed < 1.0
    deadline = time.monotonic() + 60
    while w._state is not WorkerState.UP:
        assert time.monotonic() < deadline, "no new worker"
        time.sleep(0.05)
    assert _worker_pid(w) != pid and health.get("tandem_engine_restarts_total") == 1.0
    r = _submit(w, 5, seed=5)
    assert r.done.wait(30) and r.error is None and sum(len(x) for x in r.rows) == 5


def test_channel_frames_and_end_of_stream() -> None:
    a, b = socket.socketpair()
    ca, cb = Channel(a, "a"), Channel(b, "b")
    rows = np.arange(12, dtype=np.int64).reshape(3, 4)
    ca.send(Reply(7, True, rows=Array.of(rows), timings="{}"))
    ca.send(Cancel(7))
    got = cb.recv()
    assert isinstance(got, Reply) and got.req_id == 7 and got.final
    assert got.rows is not None and np.array_equal(got.rows.numpy(), rows) and got.timings == "{}"
    assert cb.recv() == Cancel(7)
    ca.close()
    assert cb.recv() is None  # the peer is gone: end of stream, at once
    cb.close()


def test_worker_metrics_aggregate_until_the_next_beat() -> None:
    m = BeatMetrics()
    m.set("tandem_free_pages", 5)
    m.set("tandem_free_pages", 7)
    m.inc("tandem_streams_total", outcome="finished")
    m.inc("tandem_streams_total", 2, outcome="finished")
    m.observe("tandem_step_seconds", 0.0015)
    beat = m.beat(0.25)
    assert isinstance(beat, Beat) and beat.loop_age_s == 0.25
    assert beat.sets == [("tandem_free_pages", {}, 7.0)]
    assert beat.incs == [("tandem_streams_total", {"outcome": "finished"}, 3.0)]
    assert beat.observes == [("tandem_step_seconds", {}, 0.0015)]
    assert m.beat(0.0) == Beat(0.0)  # nothing new


def test_beats_queued_behind_a_slow_publish_merge_to_the_newest_gauges() -> None:
    """The publisher merges what queued while it published: gauges last value, counters summed,
    histogram samples all kept (a lagging gauge once showed a fault row pages that had come back)."""
    first = Beat(
        0.1,
        sets=[("tandem_free_pages", {}, 90.0), ("tandem_inflight_streams", {}, 2.0)],
        incs=[("tandem_streams_total", {"outcome": "finished"}, 1.0)],
        observes=[("tandem_step_seconds", {}, 0.001)],
    )
    second = Beat(
        0.1,
        sets=[("tandem_free_pages", {}, 100.0)],
        incs=[
            ("tandem_streams_total", {"outcome": "finished"}, 2.0),
            ("tandem_streams_total", {"outcome": "failed"}, 1.0),
        ],
        observes=[("tandem_step_seconds", {}, 0.002)],
    )
    merged = BeatMetrics()
    merged.record(first)
    merged.record(second)
    out = merged.beat(0.0)
    sets, incs, observes = out.sets, out.incs, out.observes
    assert sorted(sets) == [("tandem_free_pages", {}, 100.0), ("tandem_inflight_streams", {}, 2.0)]
    assert sorted(incs, key=str) == sorted(
        [
            ("tandem_streams_total", {"outcome": "finished"}, 3.0),
            ("tandem_streams_total", {"outcome": "failed"}, 1.0),
        ],
        key=str,
    )
    assert observes == [("tandem_step_seconds", {}, 0.001), ("tandem_step_seconds", {}, 0.002)]
    assert BeatMetrics().beat(0.0) == Beat(0.0)  # nothing merged, nothing to publish
