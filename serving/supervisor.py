"""`tandem-unit`: runs one unit's tritonserver, heals what dies inside it, owns its readiness.

Called as `tandem-unit [options] -- <tritonserver args>` (or `python -m tandem.serving.supervisor`),
once per unit: by `make serve`, the pod's entry point, the device scripts. Each engine (P, D, the
monolithic engine, the voice registrar) runs in a worker process that its model's stub starts and
restarts itself (serving/engine_worker.py, docs/failure-semantics.md "Engines in processes of their
own"): a dead or stalled engine is the stub's business. What is left is composed here, one duty per
module, each opening with its contract:

* the server's arguments (`serving/server_args.py`): explicit model control, loopback addresses,
  Triton's drain bound (`--drain-timeout`), no auto-complete, and a shared-memory prefix of the unit's
  (`tandem_<uid>_<unit>_<hash of the unit dir>_`) unless given; `--` options are `unit_options.py`'s;
* the server process and its probes (`serving/server_process.py`): started through the launcher,
  killed whole, probed for liveness (`--probe-failures` failed probes in a row: a hung server);
* what a dead server leaves (`serving/leftovers.py`): the unit's lock (a second supervisor of the
  unit fails at start, naming the setting to change), its /dev/shm regions, its stray processes;
* dead stubs and their reloads (`serving/stub_healing.py`), readiness (`serving/readiness.py`);
* the engines' health and its graces (`serving/engine_watch.py`): a speech engine down for
  `--engine-down-grace` restarts the server, a voices engine's reloads only its model;
* with `--proxy`, the unit's IPC proxy sidecar (`serving/proxy_process.py`); with `--mps auto|on`,
  the unit's CUDA MPS control daemon where engines share a GPU (`serving/mps.py`);
* the unit's API key (`serving/api_key.py`) on its own calls to the server.

The main loop (`Supervisor.run`) owns what is left: restarts and signals. A server that exits
unexpectedly (Triton 2.51 aborts when a stub that stalled under traffic resumes) or that a check
gives up on is restarted (its tree killed first), at most `--max-server-restarts` times a minute,
then the supervisor exits non-zero so that the pod's supervisor takes over. SIGTERM/SIGINT are
forwarded to the server (a second one kills it), its tree is killed `--stop-timeout` later and the
supervisor exits 0 once it is gone. If the supervisor itself dies (`kill -9`), the kernel SIGKILLs
the server (PR_SET_PDEATHSIG): every client's connection breaks at once, each stub's watcher kills
its stub and removes its region within a second, each worker exits with its channel.

It imports neither torch nor Triton, and keeps running when the model code cannot import.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from tandem.backend.voices.store import STATE_DIR_ENV, default_state_dir
from tandem.serving import mps
from tandem.serving.api_key import UNIT_PARAMETER, ApiKeyError, resolve, unit_dir, unit_of
from tandem.serving.control_api import ControlApi
from tandem.serving.engine_watch import EngineWatch
from tandem.serving.leftovers import Regions, UnitTaken, take_unit_lock
from tandem.serving.proxy_process import ProxyProcess
from tandem.serving.readiness import ReadinessMark
from tandem.serving.repository import model_parameter
from tandem.serving.server_args import (
    LOOPBACK,
    SHM_PREFIX_OPTION,
    find_model_dir,
    http_base,
    metrics_url,
    option_values,
    shm_prefix,
    strict_readiness,
    with_auto_complete_off,
    with_exit_timeout,
    with_explicit_control,
    with_loopback,
)
from tandem.serving.server_process import GiveUp, ServerProbe, ServerProcess, exit_status
from tandem.serving.stub_guard import STATE_ENV
from tandem.serving.stub_healing import StubHealer, UnitState
from tandem.serving.unit_options import parse

__all__ = [  # the argument helpers and the unit's lock error, importable from here as before the split
    "LOOPBACK",
    "SHM_PREFIX_OPTION",
    "Supervisor",
    "UnitTaken",
    "find_model_dir",
    "http_base",
    "main",
    "metrics_url",
    "option_values",
    "parse",
    "shm_prefix",
    "with_auto_complete_off",
    "with_exit_timeout",
    "with_explicit_control",
    "with_loopback",
]

RESTART_WINDOW_S = 60.0
REPEAT_SIGNAL_S = 0.5  # a second stop signal sooner than this is the same stop (see on_signal)


def log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} tandem-unit: {msg}", file=sys.stderr, flush=True)


class Supervisor:
    """One unit's supervision: the parts below, composed by the main loop (`run`)."""

    def __init__(self, opts: argparse.Namespace, server_args: Sequence[str]) -> None:
        self.opts = opts
        self.model: str = opts.prefill_model
        self.args = with_auto_complete_off(
            with_exit_timeout(with_loopback(with_explicit_control(server_args)), opts.drain_timeout)
        )
        self.api = resolve(self.args)  # the key the launcher locks the server with (serving/api_key.py)
        self.stopping = False
        self.stop_deadline = float("inf")
        self.stop_signalled = float("-inf")  # when the first stop signal came
        self.restarts: collections.deque[float] = collections.deque()
        self.mps: mps.MpsDaemon | None = None  # the unit's MPS daemon (serving/mps.py), set by run()
        self.metrics_url = metrics_url(self.args)
        self.unit = unit_of(self.args)
        model_dir = find_model_dir(self.args, self.model)
        if model_dir is not None:
            self.unit = model_parameter(model_dir.parent, self.model, UNIT_PARAMETER) or self.unit
        self.dir = unit_dir(self.unit, os.environ)
        self._lock_fd = take_unit_lock(self.dir, self.unit, self.model)
        prefix = shm_prefix(self.args)
        if prefix is None:
            # /dev/shm is the host's: the unit dir's path (unit name and XDG_RUNTIME_DIR) keeps two
            # units of one user apart, so that neither removes the other's regions.
            tag = hashlib.sha256(str(self.dir).encode()).hexdigest()[:8]
            prefix = f"tandem_{os.getuid()}_{self.unit}_{tag}_"
            self.args.append(f"--backend-config=python,{SHM_PREFIX_OPTION}={prefix}")
        self.prefix: str = prefix
        self.regions = Regions(self.prefix, log)
        self.repos = option_values(self.args, "--model-repository", "--model-store")
        self.http = http_base(self.args)
        self.state = UnitState(self.dir / "unit-state.json")
        self.control = ControlApi(self.http, self.api.http_headers())
        self.healer = StubHealer(self.control, self.repos, self.prefix, self.state, log, opts.reload_timeout)
        self.readiness = ReadinessMark(self.control, log)
        if not strict_readiness(self.args):
            log("--strict-readiness is off: the unit cannot hold /v2/health/ready false while speech is down")
        # What the unit keeps across restarts (registered voices): its own directory, never one
        # shared by every unit of the OS user (backend/voices/store.py reads STATE_DIR_ENV).
        self.state_dir = Path(opts.state_dir) if opts.state_dir else default_state_dir(self.unit, os.environ)
        self.server = ServerProcess(self.args, self.api, self.regions, log)
        self.probe = ServerProbe(
            self.http, self.metrics_url, opts.probe_interval, opts.probe_timeout, opts.probe_failures, log
        )
        self.engines = EngineWatch(self.metrics_url, opts.engine_down_grace, self.healer, self.readiness, log)
        self.proxy = ProxyProcess(self.unit, log) if opts.proxy else None
        self.stub_pids: frozenset[int] = frozenset()  # per server lifetime (reset by start_server)
        key = f"; API key in {self.api.source}" if self.api.source else ""
        log(f"unit {self.unit!r} (unit dir {self.dir}{key}): engines' health from {self.metrics_url}")

    # ---- the server: started, stopped, restarted within the budget (serving/server_process.py) ----

    def start_server(self) -> None:
        proc = self.server.start(
            self.mps, {STATE_ENV: str(self.state.path), STATE_DIR_ENV: str(self.state_dir.resolve())}
        )
        self.engines.reset()
        self.stub_pids = frozenset()
        self.healer.reset(proc)
        self.readiness.reset()
        self.probe.reset()

    def stop_server(self, timeout_s: float) -> int:
        self.healer.server = None  # its reload threads end (they act only on the server they began on)
        return self.server.stop(timeout_s)

    def restart_server(self, reason: str, hung: bool = False) -> None:
        """Stop (if still running; a `hung` one is killed at once) and start the server again, within
        the restart budget."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > RESTART_WINDOW_S:
            self.restarts.popleft()
        if len(self.restarts) >= self.opts.max_server_restarts:
            log(
                f"giving up: {len(self.restarts)} server restarts within {RESTART_WINDOW_S:.0f} s "
                f"(last reason: {reason}); exiting so that the pod's supervisor takes over"
            )
            rc = self.stop_server(self.opts.stop_timeout)
            raise GiveUp(exit_status(rc) or 1)
        self.restarts.append(now)
        log(f"restarting tritonserver ({len(self.restarts)} in the last minute): {reason}")
        if hung:
            self.server.kill()
        self.stop_server(self.opts.stop_timeout)
        if not self.stopping:
            self.start_server()

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        proc = self.server.proc
        if proc is None or proc.poll() is not None:
            self.stopping = True
            return
        if self.stopping:
            # One stop often arrives twice at once (a process group's signal and a shell's forward of
            # it, `make serve`): only a signal well after the first means "now".
            if time.monotonic() - self.stop_signalled < REPEAT_SIGNAL_S:
                return
            log(f"{name} again: killing tritonserver")
            self.server.kill()
            return
        self.stopping = True
        self.stop_signalled = time.monotonic()
        self.stop_deadline = time.monotonic() + self.opts.stop_timeout
        log(f"{name}: forwarding it to tritonserver (pid {proc.pid})")
        proc.send_signal(signum)

    # ---- what each poll checks ----------------------------------------------------------------------

    def check_proxy(self) -> None:
        """A proxy that exited: a new one, then a new server (its P and D register again)."""
        if self.proxy is None or (rc := self.proxy.exited()) is None:
            return
        log(f"tandem-proxy exited with status {rc}: starting a new one")
        self.proxy.start()
        self.restart_server("the IPC proxy was restarted: every P and D registration with it is gone")

    def check_stubs(self) -> None:
        """One /proc scan: the server's tree (killed whole later) and its stubs; a dead stub's region
        goes and its model is reloaded (once the server has answered: its models loaded)."""
        self.server.watch_tree()
        if self.healer.scan(self.probe.answered):
            # not ready first: a mark sent while a load runs waits for it
            self.engines.update_readiness(self.engines.health, self.probe.answered)
        self.healer.start_pending()
        pids = frozenset(self.healer.stubs)
        if pids != self.stub_pids:
            self.regions.make_private()
            self.stub_pids = pids

    def probe_server(self) -> None:
        hung = self.probe.probe()
        if hung is not None:
            self.restart_server(hung, hung=True)

    def check_engines(self) -> None:
        """Read the engines' health; restart the server when `EngineWatch.judge` says so; hold the
        server not ready while speech lacks anything."""
        health = self.engines.read()
        if health is not None and health.engines:
            reason = self.engines.judge(health)
            if reason is not None:
                self.restart_server(reason)  # a new server: its readiness is not marked until it answers
        self.engines.update_readiness(health, self.probe.answered)

    # ---- main loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        try:
            self.mps = mps.open_daemon(self.opts.mps, self.repos, self.dir, log)
            if self.proxy is not None:
                self.proxy.start()
                if self.stopping:  # a signal came while the proxy started: no server to start
                    return 0
            self.start_server()
            while True:
                proc = self.server.proc
                assert proc is not None
                rc = proc.poll()
                if rc is not None:
                    if self.stopping:
                        log(f"tritonserver exited with status {rc}; stopped as asked")
                        self.server.reap_leftovers()
                        return 0
                    if rc >= 0 and not self.engines.ever_up and self.server.starts == 1:
                        # Its own exit during the first start: arguments or repository, not a crash.
                        log(f"tritonserver exited with status {rc} during its first start; not restarting")
                        self.server.reap_leftovers()
                        return rc or 1
                    self.restart_server(f"it exited unexpectedly with status {rc}")
                    continue
                if self.stopping:
                    if time.monotonic() > self.stop_deadline:
                        log(
                            f"tritonserver still running {self.opts.stop_timeout:.0f} s "
                            "after the signal; killing it"
                        )
                        self.server.kill()
                        self.stop_deadline = float("inf")
                else:
                    self.check_proxy()
                    self.check_stubs()
                    self.probe_server()
                    if self.server.running():
                        self.check_engines()
                time.sleep(self.opts.poll_interval)
        except GiveUp as give_up:
            if self.server.running():  # e.g. a proxy that will not start
                self.stop_server(self.opts.stop_timeout)
            return give_up.status
        except mps.MpsError as exc:
            log(f"cannot share the GPU without time-slicing: {exc}")
            return 2
        finally:
            if self.proxy is not None:
                self.proxy.stop()
            if self.mps is not None:  # after the server and its engines, the daemon's clients
                self.mps.stop()


def main(argv: Sequence[str] | None = None) -> None:
    opts, server_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        supervisor = Supervisor(opts, server_args)
    except ApiKeyError as exc:
        log(f"cannot lock the control APIs: {exc}")
        raise SystemExit(2) from exc
    except UnitTaken as exc:
        log(str(exc))
        raise SystemExit(2) from exc
    raise SystemExit(supervisor.run())


if __name__ == "__main__":
    main()
