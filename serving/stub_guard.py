"""Every python-backend stub's watch over itself: a heartbeat, its own up/down, an exit with its server.

Each `model.py` starts one `StubGuard` first thing in `initialize()`, before it imports anything heavy
(torch, the engine's code): the guard imports only the standard library and the metric names. It

* starts a watcher (`sh`, a child of the stub) that SIGKILLs the stub once its parent is no longer
  the tritonserver that started it (the server died and the stub was reparented), within a second,
  and removes the stub's `/dev/shm` region (nobody else will: the server is gone, and a SIGKILLed
  `tandem-unit` cannot). Its engine worker, if any, sees the channel end and exits too
  (backend/worker/main.py). Triton 2.51's stub itself keeps running for minutes after its server's
  SIGKILL, and no thread of the stub can do this: a call into the dead server (a metric update, a
  response) blocks holding the GIL.
* publishes `tandem_engine_up{model, model_instance}` 0 at once: the series a dead stub of the same
  instance left at 1 (Triton keeps a dead stub's series at their last values) reads 0 from the moment
  `tandem-unit`'s reload starts this stub, not only once the engine's code has imported. The same
  sink (`health`) is the engine worker's (serving/engine_worker.py sets 1 while its worker serves);
  a model without a worker (frontend, vocoder) calls `serving()` at the end of `initialize()`, which
  sets 1. One metric object per series in this process: two would share one Prometheus series and
  the first deleted would free it under the other.
* every `PERIOD_S` once it serves (`serving()`), sets
  `tandem_stub_heartbeat_timestamp_seconds{model, model_instance}` to the Unix time. A dead stub's
  series stays on the server's metrics with its last value, so readers (`serving/health.py`) call a
  model whose heartbeat is older than `health.STUB_SILENT_S` dead: a dead or stopped stub is seen by
  `tandem-health`, the gateway's `/health` and `tandem-unit` without any of them knowing its pid. The
  first beat waits for `serving()`: a stub started again in a dead one's place (same instance name,
  same series) leaves the dead one's stale beat standing until it serves, so that the gateway still
  finds streams of the dead stub lost (gateway/stream.py) while its model is reloaded. A beat that
  comes more than `LATE_S` late says how long the stub did not run once it serves (a stop, CPU
  starvation, a garbage collection): logged, with the worst so far (during `initialize()` imports
  hold the GIL for seconds by design: not counted).
* `serving()` also freezes the garbage collector's view of everything `initialize()` built (the
  imported modules: ~300,000 objects with torch): a full collection over them took 0.6 s on a busy
  2-core machine, a stall of every thread of the stub (Triton 2.51 aborts the server when a stub that
  stalled under traffic resumes: docs/failure-semantics.md). After `gc.freeze()` a collection sees
  only what was allocated since.

At start it makes the stub's own `/dev/shm` region (its argv[2], made by the server, which Triton's
boost code creates 0644 whatever the umask) mode 0600 before any request reaches it: request tensors,
text included, pass through it. `tandem-unit` does the same for every region of its prefix.

It also publishes `tandem_model_reloads`: how often `tandem-unit` reloaded this model after a stub
death, read from the file `TANDEM_UNIT_STATE` names (written by the supervisor; 0 without one) at
start and again whenever the file changes (the unit counts a reload only once the new stub serves).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

from tandem.backend.metrics import BY_NAME, WORKER_METRICS

log = logging.getLogger("tandem")

PERIOD_S = 1.0
LATE_S = 0.5  # a beat this much later than its period is logged as a stall of the stub
# $1 the stub, $2 its server, $3 the stub's /dev/shm region (or ""): SIGKILL the stub once its parent
# is another, and remove its region (builtins only, but sleep and rm); done when the stub is gone or
# dead (a zombie its server never reaps). SIGPIPE is ignored and the kill comes before the log line:
# the server's stderr can be a pipe to `tandem-unit` (its log relay on a CPU machine), which died
# with it, and a write to it would otherwise end the watcher before its kill.
WATCH_SH = """trap '' PIPE
s=$1 p=$2 r=$3
while read -r line 2>/dev/null < /proc/$s/stat; do
  set -- $line
  [ "$3" = Z ] && exit 0
  if [ "$4" != "$p" ]; then
    kill -9 "$s"
    [ -n "$r" ] && rm -f "/dev/shm/$r"
    echo "tandem: tritonserver $p is gone; killed its stub $s" >&2
    exit 0
  fi
  sleep 1
done
"""
STATE_ENV = "TANDEM_UNIT_STATE"  # the supervisor's reload counts, {"reloads": {model: n}}


def reloads_of(model: str, env: Mapping[str, str] | None = None) -> int:
    path = (os.environ if env is None else env).get(STATE_ENV)
    if not path:
        return 0
    try:
        with open(path) as fh:
            return int(json.load(fh).get("reloads", {}).get(model, 0))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def _stub_argv() -> list[str]:
    try:
        with open("/proc/self/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def own_region(argv: list[str] | None = None) -> str:
    """This stub's /dev/shm region name (argv[2] of `triton_python_backend_stub`), or ""."""
    args = _stub_argv() if argv is None else argv
    if len(args) > 2 and args[0].endswith("triton_python_backend_stub") and "/" not in args[2]:
        return args[2]
    return ""


def private_region(argv: list[str] | None = None) -> None:
    """chmod 0600 this stub's /dev/shm region."""
    region = own_region(argv)
    if region:
        try:
            os.chmod(f"/dev/shm/{region}", 0o600)
        except OSError as exc:
            log.warning("cannot make /dev/shm/%s private: %s", region, exc)


def start_watch(region: str | None = None) -> subprocess.Popen[bytes]:
    """The watcher (`WATCH_SH`) over this stub and the server that started it: it kills the stub and
    removes its region (default: this stub's own) once the server is gone."""
    return subprocess.Popen(
        [
            "sh",
            "-c",
            WATCH_SH,
            "tandem-stub-watch",
            str(os.getpid()),
            str(os.getppid()),
            own_region() if region is None else region,
        ],
        stdin=subprocess.DEVNULL,
    )


class StubHealth:
    """The stub's `tandem_engine_up` / `tandem_engine_restarts_total` (a MetricsSink for its engine
    worker): one Triton metric object per series, created on first use, kept for the stub's life."""

    def __init__(self, pb: Any, labels: Mapping[str, str]) -> None:
        kinds = {
            "tandem_engine_up": pb.MetricFamily.GAUGE,
            "tandem_engine_restarts_total": pb.MetricFamily.COUNTER,
        }
        # Families must outlive their metrics (triton_io.TritonMetrics): both are kept here.
        self._families = {
            name: pb.MetricFamily(name=name, description=BY_NAME[name].description, kind=kinds[name])
            for name in WORKER_METRICS
        }
        self._labels = dict(labels)
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        self._lock = threading.Lock()
        self.retired = False  # finalize() began: a stub that replaced this one may own the series now

    def _metric(self, name: str, labels: Mapping[str, str]) -> Any:
        merged = {**self._labels, **labels}
        key = (name, tuple(sorted(merged.items())))
        with self._lock:
            metric = self._metrics.get(key)
            if metric is None:
                metric = self._metrics[key] = self._families[name].Metric(labels=merged)
        return metric

    def set(self, name: str, value: float, **labels: str) -> None:
        if not self.retired:
            self._metric(name, labels).set(float(value))

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        if not self.retired:
            self._metric(name, labels).increment(float(by))

    def observe(self, name: str, value: float, **labels: str) -> None:
        raise KeyError(f"{name}: the stub's health publishes gauges and counters only")


class StubGuard:
    """Started by `initialize()`, stopped by `finalize()` (or by the stub's exit)."""

    def __init__(self, pb: Any, args: Mapping[str, Any]) -> None:
        self.model = str(args["model_name"])
        self.instance = str(args["model_instance_name"])
        region = own_region()
        private_region()
        labels = {"model": self.model, "model_instance": self.instance}
        gauge = pb.MetricFamily.GAUGE
        # Families must outlive their metrics (triton_io.TritonMetrics): both are kept here.
        self._families = [
            pb.MetricFamily(name=name, description=BY_NAME[name].description, kind=gauge)
            for name in ("tandem_stub_heartbeat_timestamp_seconds", "tandem_model_reloads")
        ]
        self.health = StubHealth(pb, labels)
        self.health.set("tandem_engine_up", 0.0)  # over a dead predecessor's 1, before anything slow
        self._beat = self._families[0].Metric(labels=labels)
        self._reloads = self._families[1].Metric(labels=labels)
        self._state_seen: float | None = None
        self._publish_reloads()
        self.worst_late_s = 0.0  # since serving(): initialize()'s imports hold the GIL by design
        self._serving = False
        self._stop = threading.Event()
        self._watcher = start_watch(region)
        threading.Thread(target=self._run, name=f"{self.instance}-beat", daemon=True).start()

    def serving(self, engine: bool = False) -> None:
        """The end of `initialize()`: freeze the collector's view of what it built; without an engine
        worker (`engine` False), the stub itself is what serves: `tandem_engine_up` 1."""
        gc.freeze()
        self._serving = True
        self._beat.set(time.time())
        if not engine:
            self.health.set("tandem_engine_up", 1.0)

    def _publish_reloads(self) -> None:
        path = os.environ.get(STATE_ENV)
        try:
            mtime = os.stat(path).st_mtime if path else None
        except OSError:
            mtime = None
        if mtime is not None and mtime == self._state_seen:
            return
        self._state_seen = mtime
        self._reloads.set(float(reloads_of(self.model)))

    def _run(self) -> None:
        due = time.monotonic() + PERIOD_S
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            late = time.monotonic() - due
            due = time.monotonic() + PERIOD_S
            if late > LATE_S and self._serving:
                self.worst_late_s = max(self.worst_late_s, late)
                log.warning(
                    "%s: stub did not run for %.2f s (its heartbeat came late; worst so far %.2f s)",
                    self.instance,
                    late + PERIOD_S,
                    self.worst_late_s + PERIOD_S,
                )
            try:
                if self._serving:
                    self._beat.set(time.time())
                self._publish_reloads()
            except Exception:  # the server is shutting down: the next beat, or the watch's exit
                log.debug("%s: heartbeat not published", self.instance, exc_info=True)

    def retire(self) -> None:
        """First thing in `finalize()`: this stub no longer speaks for its instance. A reload of a
        live stub (tandem-unit's, of `voices` after its grace) starts the new stub before the old one
        finalizes, and both publish the same series: the old one's last word (its worker stopped:
        `tandem_engine_up` 0, `serving/engine_worker.py`) would stand over the new one's 1. A stub
        unloaded for good is seen by its heartbeat, which stops."""
        self.health.retired = True
        self._serving = False

    def close(self) -> None:
        self.retire()
        self._stop.set()
        self._watcher.kill()
        self._watcher.wait()
