"""Every python-backend stub's watch over itself: a heartbeat on the metrics, an exit with its server.

Each `model.py` starts one `StubGuard` first thing in `initialize()`. It starts

* a watcher (`sh`, a child of the stub) SIGKILLs the stub once its parent is no longer the
  tritonserver that started it (the server died and the stub was reparented), within a second. Its
  engine worker, if any, sees the channel end and exits too (backend/worker/main.py). Triton 2.51's
  stub itself keeps running for minutes after its server's SIGKILL, and no thread of the stub can
  do this: a call into the dead server (a metric update, a response) blocks holding the GIL.
* every `PERIOD_S`, sets `tandem_stub_heartbeat_timestamp_seconds{model, model_instance}` to the
  Unix time. A dead stub's series stays on the server's metrics with its last value (Triton keeps
  it, and keeps `tandem_engine_up` at its last value too), so readers (`serving/health.py`) call a
  model whose heartbeat is older than `health.STUB_SILENT_S` dead: a dead stub is seen by
  `tandem-health`, the gateway's `/health` and `tandem-unit` without any of them knowing its pid.

At start it makes the stub's own `/dev/shm` region (its argv[2], made by the server, which Triton's
boost code creates 0644 whatever the umask) mode 0600 before any request reaches it: request tensors,
text included, pass through it. `tandem-unit` does the same for every region of its prefix.

It also publishes `tandem_model_reloads`: how often `tandem-unit` reloaded this model after a stub
death, read from the file `TANDEM_UNIT_STATE` names (written by the supervisor; 0 without one).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import Any

from tandem.backend.metrics import BY_NAME

log = logging.getLogger("tandem")

PERIOD_S = 1.0
# $1 the stub, $2 its server: SIGKILL the stub once its parent is another (builtins only, but sleep);
# done when the stub is gone or dead (a zombie its server never reaps).
WATCH_SH = """s=$1 p=$2
while read -r line 2>/dev/null < /proc/$s/stat; do
  set -- $line
  [ "$3" = Z ] && exit 0
  if [ "$4" != "$p" ]; then
    echo "tandem: tritonserver $p is gone; killing its stub $s" >&2
    kill -9 "$s"
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


def private_region(argv: list[str] | None = None) -> None:
    """chmod 0600 this stub's /dev/shm region (argv[2] of `triton_python_backend_stub`)."""
    args = argv
    if args is None:
        try:
            with open("/proc/self/cmdline", "rb") as fh:
                args = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            return
    if len(args) > 2 and args[0].endswith("triton_python_backend_stub") and "/" not in args[2]:
        try:
            os.chmod(f"/dev/shm/{args[2]}", 0o600)
        except OSError as exc:
            log.warning("cannot make /dev/shm/%s private: %s", args[2], exc)


class StubGuard:
    """Started by `initialize()`, stopped by `finalize()` (or by the stub's exit)."""

    def __init__(self, pb: Any, args: Mapping[str, Any]) -> None:
        self.model = str(args["model_name"])
        self.instance = str(args["model_instance_name"])
        self._server = os.getppid()
        private_region()
        labels = {"model": self.model, "model_instance": self.instance}
        gauge = pb.MetricFamily.GAUGE
        # Families must outlive their metrics (triton_io.TritonMetrics): both are kept here.
        self._families = [
            pb.MetricFamily(name=name, description=BY_NAME[name].description, kind=gauge)
            for name in ("tandem_stub_heartbeat_timestamp_seconds", "tandem_model_reloads")
        ]
        self._beat = self._families[0].Metric(labels=labels)
        self._reloads = self._families[1].Metric(labels=labels)
        self._reloads.set(float(reloads_of(self.model)))
        self._beat.set(time.time())
        self._stop = threading.Event()
        self._watcher = subprocess.Popen(
            ["sh", "-c", WATCH_SH, "tandem-stub-watch", str(os.getpid()), str(self._server)],
            stdin=subprocess.DEVNULL,
        )
        threading.Thread(target=self._run, name=f"{self.instance}-beat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self._beat.set(time.time())
            except Exception:  # the server is shutting down: the next beat, or the watch's exit
                log.debug("%s: heartbeat not published", self.instance, exc_info=True)

    def close(self) -> None:
        self._stop.set()
        self._watcher.kill()
        self._watcher.wait()
