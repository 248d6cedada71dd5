"""The stub's side of an engine worker: start it, forward to it, relay its answers, supervise it.

Triton 2.51's python backend aborts the whole server when a stub that stalled for seconds under
arriving requests resumes (docs/failure-semantics.md, "Engines in processes of their own"), and never
restarts a dead decoupled stub. So no stub runs an engine: each model instance's `initialize()` starts
one worker process (`tandem-engine <model> <instance> ...`, `backend/worker/host.py`) and this object
stands between Triton and it, modelled on vLLM V1's `MPClient` in front of its `EngineCoreProc`:

    execute thread: validate (engine_stub.py) -> `submit`: a req_id, the responder kept in `_pending`,
                    the Submit queued on the channel (never waits for the worker)
    reader thread:  one per worker process: Reply -> the request's response sender (FINAL on the
                    last), Fail -> its one error, Beat -> liveness, and its metrics to the publisher
                    thread (which publishes them through Triton); end of stream -> the worker died
    watchdog:       every 50 ms: a stall (no frame for `stall_timeout_s`, or the engine loop stuck in
                    one iteration that long) fails every pending request with
                    `[UNAVAILABLE] <model>: engine not responding` and tells the worker to drop them
                    (Cancel, read when it resumes; it then frees their pages); a dead worker is started
                    again with bounded backoff; a client cancel Triton reports is forwarded.

States (`WorkerState`): STARTING -> UP <-> STALLED; UP/STALLED -> DEAD -> (backoff) STARTING; any ->
CLOSED (finalize). Only UP accepts requests; in any other state a request fails at once with
UNAVAILABLE naming the model and the state, so no request waits longer than `stall_timeout_s` for an
engine that does not answer.

Published here, labelled `model` and `model_instance` (what `serving/health.py` reads):
`tandem_engine_up` (1 only while UP) and `tandem_engine_restarts_total` (exported at 0 from start-up).

Nothing here is specific to P, D or the monolithic engine beyond the `kind` word handed to the
worker: a codec (the vocoder) can run in a worker the same way once `backend/worker/host.py` builds it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

from tenacity import Retrying, retry_if_exception_type, wait_exponential

from tandem.backend.errors import ErrorCode, TandemError
from tandem.backend.metrics import MetricsSink
from tandem.backend.settings import WorkerSettings
from tandem.backend.worker.channel import (
    EXIT_FOR_PROOF,
    Beat,
    Cancel,
    Channel,
    EngineKind,
    Fail,
    Init,
    Ready,
    Reply,
    Stop,
    Submit,
)
from tandem.backend.worker.metrics import BeatMetrics
from tandem.serving.repository import repository_unit
from tandem.transfer.control import UNIT_PARAMETER

log = logging.getLogger("tandem")

WATCH_S = 0.05
CANCEL_POLL_S = 0.5  # each `is_cancelled()` is a round trip to the server process
DEATH_WINDOW_S = 60.0
CRASH_LOOP_DEATHS = 3  # deaths within DEATH_WINDOW_S that make a crash loop (said once)


class EngineUnavailable(TandemError):
    """The model's engine cannot take or finish the request now (stalled, dead, restarting)."""

    code = ErrorCode.UNAVAILABLE


class RelayedError(TandemError):
    """An error the worker's engine reported; `message` already carries its `[CODE]` prefix."""

    def __init__(self, code: str, message: str) -> None:
        Exception.__init__(self, message)
        self.code = ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL
        self.detail = message


class WorkerStartFailed(Exception):
    """A worker did not reach Ready (it exited, reported a start error, or timed out)."""


class WorkerState(IntEnum):
    STARTING = 0
    UP = 1
    STALLED = 2
    DEAD = 3
    CLOSED = 4


class Responder(Protocol):
    """One request's way back to its client (engine_stub.py); called from this module's threads."""

    def reply(self, reply: Reply) -> None: ...

    def fail(self, error: TandemError) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class _Pending:
    responder: Responder
    cancel_sent: bool = False


@dataclass
class _Process:
    """One worker process and its channel (a new one after each restart)."""

    proc: subprocess.Popen[bytes]
    channel: Channel
    ready: Ready
    last_frame: float
    loop_age_s: float = 0.0


def with_unit(model_config: str, model_dir: object) -> str:
    """`model_config` (Triton's JSON) with `UNIT_PARAMETER` set to the repository's own unit
    (`serving.repository.repository_unit` of the model directory's parent) when it names none: two
    servers of two repositories on one host then never share P's slot or D's arena."""
    config = json.loads(model_config)
    params = config.setdefault("parameters", {})
    if UNIT_PARAMETER in params or not model_dir:
        return model_config
    params[UNIT_PARAMETER] = {
        "string_value": repository_unit(os.path.dirname(os.path.realpath(str(model_dir))))
    }
    return json.dumps(config)


def python_executable() -> str:
    """The interpreter for the worker: this environment's. Inside a Triton stub `sys.executable` is
    the stub binary, so fall back to the environment's `bin/python3`, then PATH's."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    for cand in (os.path.join(sys.prefix, "bin", "python3"), shutil.which("python3")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise WorkerStartFailed("no python interpreter found to run tandem-engine")


class EngineWorker:
    """Owns the worker process(es) of one model instance for the model's lifetime.

    `args` are Triton's `initialize` arguments; `metrics` publishes what the worker records;
    `health` publishes `tandem_engine_up` / `tandem_engine_restarts_total` (labels model,
    model_instance). Thread-safety: `submit` from Triton's execute threads, everything else from this
    object's own threads; `_lock` guards state, the current process and `_pending`."""

    def __init__(
        self,
        args: Mapping[str, Any],
        kind: EngineKind,
        settings: WorkerSettings,
        metrics: MetricsSink,
        health: MetricsSink,
    ) -> None:
        self.model = str(args["model_name"])
        self.instance = str(args["model_instance_name"])
        self._init = Init(
            model=self.model,
            instance=self.instance,
            kind=EngineKind(kind),
            instance_kind=str(args.get("model_instance_kind", "CPU")),
            device_id=int(args.get("model_instance_device_id", 0)),
            model_config=with_unit(str(args["model_config"]), args.get("model_repository")),
        )
        self.settings = settings
        self._metrics = metrics
        self._health = health
        self._lock = threading.Lock()
        self._state = WorkerState.STARTING
        self._proc: _Process | None = None
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._deaths: deque[float] = deque()
        self._looping = False
        self._closed = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"{self.instance}-watchdog", daemon=True)
        self._stalled_since = 0.0
        self._last_cancel_poll = 0.0
        self._beats: queue.SimpleQueue[Beat | None] = queue.SimpleQueue()
        self._publisher = threading.Thread(
            target=self._publish_loop, name=f"{self.instance}-metrics", daemon=True
        )
        health.set("tandem_engine_up", 0.0)
        health.inc("tandem_engine_restarts_total", 0.0)

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> Ready:
        """Start the first worker and wait for its Ready (Triton's load waits with us). Raises
        WorkerStartFailed: the model then fails to load, with the worker's reason."""
        p = self._spawn()
        self._publisher.start()
        self._go_up(p)
        self._watchdog.start()
        return p.ready

    def close(self) -> None:
        """finalize(): Stop the worker (it tells its clients), wait `stop_timeout_s`, then kill it;
        whatever is still pending is failed here. Idempotent."""
        with self._lock:
            if self._state is WorkerState.CLOSED:
                return
            self._state = WorkerState.CLOSED
            p, self._proc = self._proc, None
        self._closed.set()
        if p is not None:
            p.channel.send(Stop())
            try:
                p.proc.wait(self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.error("%s: worker pid %d did not stop; killing it", self.instance, p.proc.pid)
                p.proc.kill()
                p.proc.wait()
            p.channel.close()
        self._fail_pending(EngineUnavailable(f"{self.model}: the model is being unloaded"))
        self._beats.put(None)
        self._health.set("tandem_engine_up", 0.0)

    # ---- requests (execute threads) --------------------------------------------------------------

    def submit(self, build: Callable[[int], Submit], responder: Responder) -> None:
        """Forward one validated request, or fail it at once when the engine is not UP. Never blocks
        on the worker (the channel queues)."""
        with self._lock:
            state, p = self._state, self._proc
            if state is WorkerState.UP and p is not None:
                req_id = self._next_id
                self._next_id += 1
                self._pending[req_id] = _Pending(responder)
        if state is not WorkerState.UP or p is None:
            responder.fail(EngineUnavailable(self._why(state)))
            return
        p.channel.send(build(req_id))

    def _why(self, state: WorkerState) -> str:
        if state is WorkerState.STALLED:
            stalled = time.monotonic() - self._stalled_since
            return f"{self.model}: engine not responding (stalled {stalled:.1f} s)"
        if state is WorkerState.CLOSED:
            return f"{self.model}: the model is being unloaded"
        return f"{self.model}: engine restarting after its worker died"

    # ---- the worker process ----------------------------------------------------------------------

    def _spawn(self) -> _Process:
        """Start one worker and wait for Ready; raises WorkerStartFailed."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [
            python_executable(),
            "-m",
            "tandem.backend.worker.main",
            self.model,
            self.instance,
            "--kind",
            self._init.kind,
            "--fd",
            str(theirs.fileno()),
        ]
        try:
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except OSError as exc:
            mine.close()
            raise WorkerStartFailed(f"cannot start {argv[0]}: {exc}") from None
        finally:
            theirs.close()
        log.info(
            "%s: started engine worker pid %d (tandem-engine %s %s --kind %s)",
            self.instance,
            proc.pid,
            self.model,
            self.instance,
            self._init.kind,
        )
        channel = Channel(mine, f"{self.instance}-stub")
        channel.send(self._init)
        mine.settimeout(self.settings.start_timeout_s)
        first = channel.recv()
        mine.settimeout(None)
        if isinstance(first, Ready):
            return _Process(proc, channel, first, time.monotonic())
        channel.close()
        if proc.poll() is None:
            proc.kill()
        rc = proc.wait()
        if isinstance(first, Fail):
            raise WorkerStartFailed(f"{self.model} engine did not start: {first.message}")
        raise WorkerStartFailed(
            f"{self.model} engine worker pid {proc.pid} exited with status {rc} before it was ready"
            if first is None
            else f"{self.model} engine worker sent {type(first).__name__} before Ready"
        )

    def _go_up(self, p: _Process) -> None:
        with self._lock:
            if self._state is WorkerState.CLOSED:
                closing = True
            else:
                closing = False
                self._proc, self._state = p, WorkerState.UP
        if closing:  # finalize() came while this worker started: it never serves
            p.channel.send(Stop())
            try:
                p.proc.wait(self.settings.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.proc.kill()
            return
        threading.Thread(target=self._read, args=(p,), name=f"{self.instance}-relay", daemon=True).start()
        self._health.set("tandem_engine_up", 1.0)
        log.info("%s: engine worker pid %d serves (%s)", self.instance, p.ready.pid, p.ready.detail)

    def _read(self, p: _Process) -> None:
        """Relay thread of one worker process: its frames in order until end of stream."""
        try:
            while True:
                msg = p.channel.recv()
                if msg is None:
                    break
                p.last_frame = time.monotonic()
                if isinstance(msg, Reply):
                    self._relay(msg)
                elif isinstance(msg, Fail):
                    with self._lock:
                        pending = self._pending.pop(msg.req_id, None)
                    if pending is not None:
                        pending.responder.fail(RelayedError(msg.code, msg.message))
                elif isinstance(msg, Beat):
                    p.loop_age_s = msg.loop_age_s
                    self._beats.put(msg)  # published on its own thread: replies never wait behind it
                    self._maybe_recover(p)
        except Exception:
            log.exception("%s: relay of worker pid %d failed", self.instance, p.proc.pid)
        self._on_exit(p)

    def _relay(self, msg: Reply) -> None:
        with self._lock:
            pending = self._pending.pop(msg.req_id, None) if msg.final else self._pending.get(msg.req_id)
        if pending is None:  # failed by the stub during a stall, or cancelled: the worker drops it
            return
        try:
            pending.responder.reply(msg)
        except Exception as exc:  # one client's broken response must not stop the relay
            log.exception("%s: could not send a response of request %d", self.instance, msg.req_id)
            with self._lock:
                self._pending.pop(msg.req_id, None)
            pending.responder.fail(EngineUnavailable(f"{self.model}: response failed: {exc}"))

    def _publish_loop(self) -> None:
        """Publisher thread: the worker's metrics through Triton. Each update is a round trip to the
        server process, so this runs apart from the relay (a reply never waits behind a histogram).
        Beats that queued while a publish ran are merged first (`BeatMetrics.record`): under load the
        gauges show the newest reading, never one that lags further behind with every beat."""
        m = self._metrics
        while True:
            beats = [self._beats.get()]
            while True:
                try:
                    beats.append(self._beats.get_nowait())
                except queue.Empty:
                    break
            stop = None in beats
            merged = BeatMetrics()
            for b in beats:
                if b is not None:
                    merged.record(b)
            try:
                merged.beat(0.0).replay(m)
            except Exception:
                log.exception("%s: publishing the worker's metrics failed", self.instance)
            if stop:
                return

    def _on_exit(self, p: _Process) -> None:
        """End of stream: the worker is gone. Its pending requests fail now; the watchdog restarts it."""
        try:
            rc: int | None = p.proc.wait(2.0)
        except subprocess.TimeoutExpired:  # closed its end but lingers: it no longer serves us
            p.proc.kill()
            rc = p.proc.wait()
        p.channel.close()
        with self._lock:
            if self._proc is not p or self._state is WorkerState.CLOSED:
                return
            self._proc, self._state = None, WorkerState.DEAD
            self._deaths.append(time.monotonic())
        self._health.set("tandem_engine_up", 0.0)
        why = "exited for proof (held ABORT_ACKs)" if rc == EXIT_FOR_PROOF else f"exited with status {rc}"
        n = self._fail_pending(
            EngineUnavailable(f"{self.model}: engine died (worker pid {p.proc.pid} {why}); restarting it")
        )
        log.error("%s: engine worker pid %d %s; failed %d requests", self.instance, p.proc.pid, why, n)

    def _fail_pending(self, error: TandemError) -> int:
        with self._lock:
            pending, self._pending = self._pending, {}
        for entry in pending.values():
            try:
                entry.responder.fail(error)
            except Exception:
                log.exception("%s: could not fail a request", self.instance)
        return len(pending)

    # ---- watchdog ----------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed.wait(WATCH_S):
            try:
                with self._lock:
                    state, p = self._state, self._proc
                if state is WorkerState.DEAD:
                    self._restart()
                elif state is WorkerState.UP and p is not None:
                    self._check_stall(p)
                    self._forward_cancels(p)
            except Exception:
                log.exception("%s: watchdog iteration failed", self.instance)

    def _stalled(self, p: _Process) -> float:
        """Seconds the worker has not answered (0 when it answers)."""
        silent = time.monotonic() - p.last_frame
        age = max(silent, p.loop_age_s)
        return age if age > self.settings.stall_timeout_s else 0.0

    def _check_stall(self, p: _Process) -> None:
        stalled = self._stalled(p)
        if not stalled:
            return
        with self._lock:
            if self._state is not WorkerState.UP or self._proc is not p:
                return
            self._state = WorkerState.STALLED
            self._stalled_since = time.monotonic() - stalled
            pending, self._pending = self._pending, {}
        self._health.set("tandem_engine_up", 0.0)
        err = EngineUnavailable(f"{self.model}: engine not responding (no answer for {stalled:.1f} s)")
        for req_id, entry in pending.items():
            p.channel.send(Cancel(req_id))  # read when it resumes: it drops them and frees their pages
            entry.responder.fail(err)
        log.error(
            "%s: engine worker pid %d stalled (no answer for %.1f s): failed %d requests, refusing new ones",
            self.instance,
            p.proc.pid,
            stalled,
            len(pending),
        )

    def _maybe_recover(self, p: _Process) -> None:
        """Relay thread, on a Beat: a stalled worker that answers again serves again (no restart)."""
        if self._state is not WorkerState.STALLED or self._stalled(p):
            return
        with self._lock:
            if self._state is not WorkerState.STALLED or self._proc is not p:
                return
            self._state = WorkerState.UP
        self._health.set("tandem_engine_up", 1.0)
        log.warning(
            "%s: engine worker pid %d answers again after %.1f s",
            self.instance,
            p.proc.pid,
            time.monotonic() - self._stalled_since,
        )

    def _forward_cancels(self, p: _Process) -> None:
        """Triton's cancellation of a request (where the backend reports it) reaches the engine."""
        now = time.monotonic()
        if now - self._last_cancel_poll < CANCEL_POLL_S:
            return
        self._last_cancel_poll = now
        with self._lock:
            entries = [(i, e) for i, e in self._pending.items() if not e.cancel_sent]
        for req_id, entry in entries:
            if entry.responder.cancelled():
                entry.cancel_sent = True
                p.channel.send(Cancel(req_id))

    def _restart(self) -> None:
        """Watchdog thread: a new worker after `restart_backoff_s` (doubling with each death in the
        last minute, at most `restart_backoff_max_s`); failed starts retry on the same schedule."""
        s = self.settings
        now = time.monotonic()
        while self._deaths and now - self._deaths[0] > DEATH_WINDOW_S:
            self._deaths.popleft()
        delay = min(s.restart_backoff_max_s, s.restart_backoff_s * 2 ** max(0, len(self._deaths) - 1))
        looping = len(self._deaths) >= CRASH_LOOP_DEATHS
        if looping and not self._looping:  # said once per loop; the deaths themselves are logged each
            log.error(
                "%s: engine worker crash-looping (%d deaths in %.0f s): restarts back off, at most %.0f s "
                "apart; the other models are not affected",
                self.instance,
                len(self._deaths),
                DEATH_WINDOW_S,
                s.restart_backoff_max_s,
            )
        self._looping = looping
        if self._closed.wait(delay):
            return
        with self._lock:
            if self._state is not WorkerState.DEAD:
                return
            self._state = WorkerState.STARTING
        retrying = Retrying(
            retry=retry_if_exception_type(WorkerStartFailed),
            wait=wait_exponential(multiplier=s.restart_backoff_s, max=s.restart_backoff_max_s),
            stop=lambda _state: self._closed.is_set(),
            sleep=self._closed.wait,  # type: ignore[arg-type]  # returns a bool tenacity ignores
            before_sleep=lambda rs: log.error(
                "%s: engine worker start %d failed: %s",
                self.instance,
                rs.attempt_number,
                rs.outcome.exception() if rs.outcome else None,
            ),
            reraise=True,
        )
        try:
            p = retrying(self._spawn)
        except WorkerStartFailed:  # only when closing
            return
        self._health.inc("tandem_engine_restarts_total", 1.0)
        self._go_up(p)
