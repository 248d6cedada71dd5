"""`tandem-unit`: runs one unit's tritonserver, heals what dies inside it, owns its readiness.

Each engine (P, D, the monolithic engine, the voice registrar) runs in a worker process that its
model's stub starts and restarts itself (serving/engine_worker.py, docs/failure-semantics.md "Engines
in processes of their own"): a dead or stalled engine is the stub's business. What is left here, by
duty (each in a module of its own where it is more than a few lines):

* the server's arguments (`serving/server_args.py`): the real server through the launcher
  (`tandem.serving.launcher.build_command`), with `--model-control-mode=explicit --load-model=*`
  unless a model-control mode is given, loopback addresses unless `--grpc-address`/`--http-address`/
  `--metrics-address` are given, Triton's `--exit-timeout-secs` (the drain bound, `--drain-timeout`),
  `--disable-auto-complete-config` and a shared-memory prefix of the unit's
  (`tandem_<uid>_<unit>_<hash of the unit dir>_`, so that it removes the regions of a server that is
  gone, and only those);
* the unit's lock (`<unit dir>/unit.lock`), held for as long as it runs: a second supervisor of the
  same unit fails at start, naming the setting to change;
* dead stubs (`serving/stub_healing.py`): watched by pid every `--poll-interval`; a dead one's region
  is removed and its model reloaded by a load carrying its config (a new stub), counted once the new
  stub serves (`tandem_model_reloads`); a speech model still not back `--engine-down-grace` later
  gets the server restarted;
* readiness (`serving/readiness.py`): while a stub or an engine that speech (`tts`, `tts_mono`) needs
  is down, the server's `/v2/health/ready` and gRPC `ServerReady` say not ready (a model of the
  unit's own that cannot load); `voices` is its own failure domain and never does;
* the server's liveness (`/v2/health/live` and a metrics scrape, `--probe-timeout` each): after
  `--probe-failures` failed probes in a row it kills the server's whole tree and starts it again (a
  hung server: SIGSTOP, a deadlocked crash handler);
* the engines' truth from the server's metrics (`tandem.serving.health`: `tandem_engine_up`,
  `tandem_draining`, the stubs' heartbeats) every `--poll-interval`: logs each engine that goes down
  or comes back, restarts the server when some speech engine has been down for `--engine-down-grace`
  seconds (its stub's own restarts did not bring it back: a broken device, a start that keeps
  failing), and reloads the `voices` model (never the server) when its engine has;
* signals: SIGTERM/SIGINT are forwarded to the server (a second one kills it), its tree is killed
  `--stop-timeout` later and the supervisor exits 0 once it is gone; a server that exits unexpectedly
  (Triton 2.51 aborts when a stub that stalled under traffic resumes) is restarted (its tree killed
  first), at most `--max-server-restarts` times a minute, then the supervisor exits non-zero so that
  the pod's supervisor takes over. If the supervisor itself dies (`kill -9`), the kernel SIGKILLs the
  server (PR_SET_PDEATHSIG): every client's connection breaks at once, each stub's watcher kills its
  stub and removes its region within a second, each worker exits with its channel;
* with `--proxy`, the unit's IPC proxy sidecar (`tandem-proxy`, for the `proxy` KV path), run before
  the server and for as long as it runs. A proxy that exits takes every P and D registration with it
  (D's arena, P's staging: they are not re-made), so the supervisor starts a new proxy and then
  restarts the server, whose P and D register again; every stream of the unit fails meanwhile;
* with `--mps auto|on` (serving/mps.py), runs the unit's CUDA MPS control daemon where engines share a
  GPU, for as long as it runs, and gives tritonserver its pipe and log directories;
* the unit's API key (`serving/api_key.py`) on its own calls to the server: the launcher locks
  Triton's model-repository API (and the other control APIs) with it.

It imports neither torch nor Triton, and keeps running when the model code cannot import.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import glob
import hashlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from tandem.backend.voices.store import STATE_DIR_ENV, default_state_dir
from tandem.serving import mps, process_tree
from tandem.serving.api_key import UNIT_PARAMETER, ApiKeyError, resolve, unit_dir, unit_of
from tandem.serving.control_api import ControlApi
from tandem.serving.health import VOICES_MODELS, HealthUnavailable, UnitHealth, fetch_health
from tandem.serving.launcher import (
    CPU_MODE_LINE,
    CPU_NOISE,
    LauncherError,
    build_command,
    cpu_machine,
    relay_lines,
)
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
from tandem.serving.stub_guard import STATE_ENV
from tandem.serving.stub_healing import StubHealer, UnitState

__all__ = [  # the argument helpers, importable from here as before the split
    "LOOPBACK",
    "SHM_PREFIX_OPTION",
    "Supervisor",
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
VOICES_BACKOFF_STEPS = 4  # voices' grace reloads back off to 16 graces apart at most
_PR_SET_PDEATHSIG = 1


def log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} tandem-unit: {msg}", file=sys.stderr, flush=True)


# ---- the supervisor ------------------------------------------------------------------------------


class GiveUp(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _die_with_parent_fn(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send the child `sig` if the supervisor dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)

    return preexec


def _server_preexec_fn() -> Callable[[], None]:
    """The server's preexec_fn: umask 077, so that every file and /dev/shm region the server and its
    stubs create is its user's alone (0600), and death with the supervisor: SIGKILL, not SIGTERM. A
    SIGTERMed server drains for `--exit-timeout-secs` and then, with its stubs' finalize() still
    running, lived on for a minute (measured: ~62 s) while every client heard nothing; SIGKILLed, it
    is gone at once, its clients' streams break at once and the stubs' watchers clean up."""
    die = _die_with_parent_fn(signal.SIGKILL)

    def preexec() -> None:
        os.umask(0o077)
        if die is not None:
            die()

    return preexec


class UnitTaken(Exception):
    """Another supervisor holds this unit's lock."""


class Supervisor:
    def __init__(self, opts: argparse.Namespace, server_args: Sequence[str]) -> None:
        self.opts = opts
        self.model: str = opts.prefill_model
        self.args = with_auto_complete_off(
            with_exit_timeout(with_loopback(with_explicit_control(server_args)), opts.drain_timeout)
        )
        self.api = resolve(self.args)  # the key the launcher locks the server with (serving/api_key.py)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.stop_deadline = float("inf")
        self.stop_signalled = float("-inf")  # when the first stop signal came
        self.restarts: collections.deque[float] = collections.deque()
        self.starts = 0
        self.ever_up = False
        # per server lifetime (reset by start_server)
        self.health: UnitHealth | None = None  # the last reading of the engines
        self.down_since: float | None = None  # some speech engine down since (monotonic)
        self.voices_down_since: float | None = None  # the voices engine down since (monotonic)
        self.voices_up_since: float | None = None  # ... up since
        self.voices_reloads = 0  # grace reloads of voices that did not hold (their wait doubles)
        self.proxy: subprocess.Popen[str] | None = None
        self.proxy_starts = 0
        self.mps: mps.MpsDaemon | None = None  # the unit's MPS daemon (serving/mps.py), set by run()
        self.metrics_url = metrics_url(self.args)
        self.unit = unit_of(self.args)
        model_dir = find_model_dir(self.args, self.model)
        if model_dir is not None:
            self.unit = model_parameter(model_dir.parent, self.model, UNIT_PARAMETER) or self.unit
        self.dir = unit_dir(self.unit, os.environ)
        self._lock_fd = self._take_unit()
        self.prefix = shm_prefix(self.args)
        if self.prefix is None:
            # /dev/shm is the host's: the unit dir's path (unit name and XDG_RUNTIME_DIR) keeps two
            # units of one user apart, so that neither removes the other's regions.
            tag = hashlib.sha256(str(self.dir).encode()).hexdigest()[:8]
            self.prefix = f"tandem_{os.getuid()}_{self.unit}_{tag}_"
            self.args.append(f"--backend-config=python,{SHM_PREFIX_OPTION}={self.prefix}")
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
        # per server lifetime (reset by start_server)
        self.tree: list[int] = []
        self.stub_pids: frozenset[int] = frozenset()
        self.answered = False
        self.probe_failures = 0
        self.next_probe = 0.0
        key = f"; API key in {self.api.source}" if self.api.source else ""
        log(f"unit {self.unit!r} (unit dir {self.dir}{key}): engines' health from {self.metrics_url}")

    # ---- the unit's lock and state -----------------------------------------------------------------

    def _take_unit(self) -> int:
        """flock `<unit dir>/unit.lock` for this process's life; UnitTaken if another holds it."""
        path = self.dir / "unit.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UnitTaken(
                f"another tandem-unit serves unit {self.unit!r} ({path} is locked): give this one "
                f"another unit name (the `{UNIT_PARAMETER}` parameter of its `{self.model}` model, "
                f"e.g. `tandem-repo --set prefill:{UNIT_PARAMETER}=NAME "
                f"--set decode:{UNIT_PARAMETER}=NAME`) "
                "or another XDG_RUNTIME_DIR"
            ) from None
        return fd

    def private_regions(self) -> None:
        """chmod 0600 every region of this unit's prefix (Triton creates them 0644; each stub makes
        its own private at start, serving/stub_guard.py: this covers any other)."""
        for path in glob.glob(f"/dev/shm/{glob.escape(self.prefix or '')}*"):
            with contextlib.suppress(OSError):
                if os.stat(path).st_mode & 0o077:
                    os.chmod(path, 0o600)

    def remove_regions(self) -> None:
        """Remove the python backend's /dev/shm regions of this unit's (stopped) server."""
        removed = 0
        for path in glob.glob(f"/dev/shm/{glob.escape(self.prefix or '')}*"):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed += 1
        if removed:
            log(f"removed {removed} shared-memory regions /dev/shm/{self.prefix}* of the stopped server")

    # ---- the IPC proxy sidecar (--proxy) -----------------------------------------------------------

    def start_proxy(self) -> None:
        """Start `tandem-proxy` for this unit and wait for its ready line (GiveUp if it never comes)."""
        argv = [sys.executable, "-m", "tandem.transfer.paths.proxy_sidecar", "--unit", self.unit]
        self.proxy = subprocess.Popen(
            argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_die_with_parent_fn()
        )
        self.proxy_starts += 1
        assert self.proxy.stdout is not None
        ready, _, _ = select.select([self.proxy.stdout], [], [], 60.0)
        line = self.proxy.stdout.readline() if ready else ""  # one line when it serves, then only logs
        if "ready" not in line:
            self.proxy.kill()  # alive but silent (e.g. stuck starting CUDA): do not wait on it forever
            rc = self.proxy.wait()
            log(f"tandem-proxy for unit {self.unit!r} did not start (status {rc})")
            raise GiveUp(exit_status(rc) or 1)
        log(f"started tandem-proxy (pid {self.proxy.pid}) for unit {self.unit!r}")

    def stop_proxy(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(10)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()

    def check_proxy(self) -> None:
        if self.proxy is None or self.proxy.poll() is None:
            return
        log(f"tandem-proxy exited with status {self.proxy.returncode}: starting a new one")
        self.start_proxy()
        self.restart_server("the IPC proxy was restarted: every P and D registration with it is gone")

    # ---- server process ---------------------------------------------------------------------------

    def start_server(self) -> None:
        try:
            binary, argv, env = build_command(self.args)
        except LauncherError as exc:
            log(f"launcher: {exc}")
            raise GiveUp(2) from exc
        env = mps.server_env(env, self.mps)
        env[STATE_ENV] = str(self.state.path)
        env[STATE_DIR_ENV] = str(self.state_dir.resolve())
        self.remove_regions()  # a server of this unit killed before (we hold the unit's lock)
        self.started_at = time.time()
        cpu = cpu_machine()
        if cpu and self.starts == 0:
            log(CPU_MODE_LINE)
        self.proc = subprocess.Popen(
            argv,
            executable=binary,
            env=env,
            start_new_session=True,
            preexec_fn=_server_preexec_fn(),
            stderr=subprocess.PIPE if cpu else None,
        )
        if self.proc.stderr is not None:  # CPU: relay the server's stderr without its CUDA line
            threading.Thread(
                target=relay_lines, args=(self.proc.stderr, sys.stderr.buffer, CPU_NOISE), daemon=True
            ).start()
        self.starts += 1
        self.health = None
        self.down_since = None
        self.voices_down_since = self.voices_up_since = None
        self.voices_reloads = 0
        self.tree = []
        self.stub_pids = frozenset()
        self.healer.reset(self.proc)
        self.readiness.reset()
        self.answered = False
        self.probe_failures = 0
        self.next_probe = time.monotonic()
        log(f"started tritonserver (pid {self.proc.pid}): {self.api.redact(' '.join(argv[1:]))}")

    def stop_server(self, timeout_s: float) -> int:
        proc = self.proc
        assert proc is not None
        self.healer.server = None  # its reload threads end (they act only on the server they began on)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log(f"tritonserver did not exit {timeout_s:.0f} s after SIGTERM; killing it")
                self.kill_server()
                proc.wait()
        self.reap_leftovers()
        return proc.returncode

    def reap_leftovers(self) -> None:
        """SIGKILL what is left of an exited server (its process group, and every stub and worker
        seen in its tree): stubs and workers can outlive a killed server (an orphaned P keeps its slot
        lock, and the next server's P could not start); then remove its shared-memory regions."""
        if self.proc is None or self.proc.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, 0)
            log(f"killing the leftover processes of tritonserver {self.proc.pid} (its stubs, their workers)")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        stragglers = process_tree.kill_all(self.tree)
        if stragglers:
            log(f"killed {len(stragglers)} processes of tritonserver {self.proc.pid} outside its group")
        self.remove_regions()

    def kill_server(self) -> None:
        """SIGKILL the server's whole tree: its process group and every process seen below it."""
        if self.proc is not None and self.proc.poll() is None:
            self.tree = list({*self.tree, *process_tree.descendants(self.proc.pid)})
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its stubs (one session)
            process_tree.kill_all(self.tree)

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
            self.kill_server()
        self.stop_server(self.opts.stop_timeout)
        if not self.stopping:
            self.start_server()

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.proc is None or self.proc.poll() is not None:
            self.stopping = True
            return
        if self.stopping:
            # One stop often arrives twice at once (a process group's signal and a shell's forward of
            # it, `make serve`): only a signal well after the first means "now".
            if time.monotonic() - self.stop_signalled < REPEAT_SIGNAL_S:
                return
            log(f"{name} again: killing tritonserver")
            self.kill_server()
            return
        self.stopping = True
        self.stop_signalled = time.monotonic()
        self.stop_deadline = time.monotonic() + self.opts.stop_timeout
        log(f"{name}: forwarding it to tritonserver (pid {self.proc.pid})")
        self.proc.send_signal(signum)

    # ---- the stubs: watched by pid, a dead one's model reloaded (serving/stub_healing.py) ----------

    def check_stubs(self) -> None:
        """One /proc scan: the server's tree (killed whole later) and its stubs; a dead stub's region
        goes and its model is reloaded (once the server has answered: its models loaded)."""
        assert self.proc is not None
        self.tree = list({*self.tree, *process_tree.descendants(self.proc.pid)})
        if self.healer.scan(self.answered):
            self.update_readiness(self.health)  # not ready first: a mark sent while a load runs waits for it
        self.healer.start_pending()
        pids = frozenset(self.healer.stubs)
        if pids != self.stub_pids:
            self.private_regions()
            self.stub_pids = pids

    # ---- the server's liveness ---------------------------------------------------------------------

    def probe_server(self) -> None:
        """Every `--probe-interval`: `/v2/health/live` and a metrics scrape, each within
        `--probe-timeout`. Failures count only once the server has answered in this lifetime (its
        models load first); `--probe-failures` in a row kill its tree and restart it."""
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + self.opts.probe_interval
        timeout = self.opts.probe_timeout
        try:
            with urllib.request.urlopen(self.http + "/v2/health/live", timeout=timeout) as resp:
                resp.read()
            fetch_health(self.metrics_url, timeout_s=timeout)
        except (urllib.error.URLError, OSError, ValueError, HealthUnavailable) as exc:
            if not self.answered:
                return
            self.probe_failures += 1
            log(f"liveness probe {self.probe_failures}/{self.opts.probe_failures} failed: {exc}")
            if self.probe_failures >= self.opts.probe_failures:
                why = f"it did not answer {self.probe_failures} liveness probes in a row"
                self.restart_server(why, hung=True)
            return
        if self.probe_failures:
            log(f"tritonserver answers again after {self.probe_failures} failed probes")
        self.answered = True
        self.probe_failures = 0

    # ---- the engines ------------------------------------------------------------------------------

    def check_engines(self) -> None:
        """Read the engines' health; log what changed; restart the server after `--engine-down-grace`
        seconds with some speech engine down (its stub's own restarts have not brought it back);
        reload the voices model (never the server: its own failure domain) after as long with its
        engine down; hold the server not ready while speech lacks anything."""
        try:
            health: UnitHealth | None = fetch_health(self.metrics_url, timeout_s=2.0)
        except HealthUnavailable:
            health = None  # starting, or between scrapes of a busy server: the process check covers death
        if health is not None:
            self.ever_up = True
            if health.engines:
                self._log_changes(health)
                self.health = health
                self._grace(health)
        self.update_readiness(health)

    def _log_changes(self, health: UnitHealth) -> None:
        healing = self.healer.down
        before = {(e.model, e.model_instance): e for e in self.health.engines} if self.health else {}
        silent = {(m, i): t for m, i, t in health.silent_stubs}
        was_silent = {(m, i) for m, i, _ in self.health.silent_stubs} if self.health else set()
        for (m, i), t in silent.items():
            if (m, i) not in was_silent:
                log(f"{m} {i}: stub silent for {t:.1f} s (its heartbeat stopped)")
        for e in health.engines:
            old = before.get((e.model, e.model_instance))
            aside = "; registration only, speech unaffected" if e.model in VOICES_MODELS else ""
            if old is None and e.up:
                log(f"{e.model} {e.model_instance}: engine up")
            elif (old is None or old.up) and not e.up and (e.model, e.model_instance) in silent:
                log(f"{e.model} {e.model_instance}: engine down (its stub is silent){aside}")
            elif (old is None or old.up) and not e.up:
                why = (
                    "(its stub died: the model is being reloaded)"
                    if e.model in healing
                    else "(tandem_engine_up 0); its stub restarts it"
                )
                log(f"{e.model} {e.model_instance}: engine down {why}{aside}")
            elif old is not None and not old.up and e.up:
                log(f"{e.model} {e.model_instance}: engine up again")
            if old is not None and old.draining != e.draining:
                log(f"{e.model} {e.model_instance}: {'draining' if e.draining else 'no longer draining'}")

    def _grace(self, health: UnitHealth) -> None:
        now = time.monotonic()
        healing = self.healer.down
        if any(m in healing for m in VOICES_MODELS):
            pass  # its reload runs: judged again once it ends
        elif health.voices.engines and not health.voices_ready:
            self.voices_down_since = self.voices_down_since or now
            # a grace for the first reload, then twice as long after each that did not hold
            wait = self.opts.engine_down_grace * 2 ** min(self.voices_reloads, VOICES_BACKOFF_STEPS)
            if now - self.voices_down_since >= wait:
                down = "; ".join(health.voices_reasons)
                self.voices_reloads += 1
                log(
                    f"voices down for {now - self.voices_down_since:.0f} s ({down}): reloading the voices "
                    f"model ({self.voices_reloads} in a row), not the server (speech is unaffected)"
                )
                self.voices_down_since = now
                for model in sorted({e.model for e in health.voices.engines}):
                    self.healer.start(model, [])
        else:
            if self.voices_down_since is not None or self.voices_up_since is None:
                self.voices_up_since = now
            elif now - self.voices_up_since >= self.opts.engine_down_grace:
                self.voices_reloads = 0  # it held: the next outage starts from one grace again
            self.voices_down_since = None
        speech_healing = {m: h for m, h in healing.items() if m not in VOICES_MODELS}
        stuck = [m for m, h in speech_healing.items() if now - h.seen_at >= self.opts.engine_down_grace]
        if stuck:  # reloads have not brought a dead stub's model back: the server itself, as a last resort
            self.restart_server(
                f"{', '.join(stuck)}: its stub died {now - speech_healing[stuck[0]].seen_at:.0f} s ago and "
                "reloads did not bring it back"
            )
            return
        if health.engines_up or speech_healing:
            self.down_since = None  # all up, or a stub reload under way (its own retries)
            return
        self.down_since = self.down_since or now
        if now - self.down_since >= self.opts.engine_down_grace:
            down = "; ".join(r for r in health.reasons if not r.endswith("draining"))
            self.restart_server(f"engines down for {now - self.down_since:.0f} s: {down}")

    def update_readiness(self, health: UnitHealth | None) -> None:
        """Hold the server not ready while a speech stub is dead (its reload under way), a speech
        engine is down or a speech stub is silent; ready again once all of it is well."""
        if not self.answered:
            return  # the models are loading: Triton says not ready itself
        down = [f"{m}: its stub died (reloading)" for m in self.healer.down if m not in VOICES_MODELS]
        if health is not None and health.speech.engines:
            down += [r for r in health.reasons if not r.endswith("draining")]
        elif health is None and self.readiness.marked:
            return  # the metrics did not answer this time: keep what was said
        self.readiness.update(down)

    # ---- main loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        try:
            self.mps = mps.open_daemon(self.opts.mps, self.repos, self.dir, log)
            if self.opts.proxy:
                self.start_proxy()
                if self.stopping:  # a signal came while the proxy started: no server to start
                    return 0
            self.start_server()
            while True:
                assert self.proc is not None
                rc = self.proc.poll()
                if rc is not None:
                    if self.stopping:
                        log(f"tritonserver exited with status {rc}; stopped as asked")
                        self.reap_leftovers()
                        return 0
                    if rc >= 0 and not self.ever_up and self.starts == 1:
                        # Its own exit during the first start: arguments or repository, not a crash.
                        log(f"tritonserver exited with status {rc} during its first start; not restarting")
                        self.reap_leftovers()
                        return rc or 1
                    self.restart_server(f"it exited unexpectedly with status {rc}")
                    continue
                if self.stopping:
                    if time.monotonic() > self.stop_deadline:
                        log(
                            f"tritonserver still running {self.opts.stop_timeout:.0f} s "
                            "after the signal; killing it"
                        )
                        self.kill_server()
                        self.stop_deadline = float("inf")
                else:
                    self.check_proxy()
                    self.check_stubs()
                    self.probe_server()
                    if self.proc.poll() is None:
                        self.check_engines()
                time.sleep(self.opts.poll_interval)
        except GiveUp as give_up:
            if self.proc is not None and self.proc.poll() is None:  # e.g. a proxy that will not start
                self.stop_server(self.opts.stop_timeout)
            return give_up.status
        except mps.MpsError as exc:
            log(f"cannot share the GPU without time-slicing: {exc}")
            return 2
        finally:
            self.stop_proxy()
            if self.mps is not None:  # after the server and its engines, the daemon's clients
                self.mps.stop()


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="tandem-unit",
        usage="tandem-unit [options] -- <tritonserver args...>",
        description="Run one unit's tritonserver; restart it when it dies or its engines stay down.",
    )
    parser.add_argument(
        "--engine-down-grace",
        type=float,
        default=120.0,
        help="seconds an engine may stay down (its stub restarting it) before the server is restarted",
    )
    parser.add_argument(
        "--max-server-restarts", type=int, default=3, help="server restarts per minute before giving up"
    )
    parser.add_argument(
        "--stop-timeout", type=float, default=12.0, help="seconds after SIGTERM before the tree is killed"
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=8.0,
        help="Triton's --exit-timeout-secs unless given: how long a stopping server drains requests",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="what the unit keeps across restarts (registered voices: DIR/voices, unless the models set "
        "tandem.voices.dir); default: $XDG_STATE_HOME/tandem/units/<unit>",
    )
    parser.add_argument("--probe-interval", type=float, default=2.0, help="seconds between liveness probes")
    parser.add_argument("--probe-timeout", type=float, default=3.0, help="seconds each probe may take")
    parser.add_argument(
        "--probe-failures",
        type=int,
        default=5,
        help="failed liveness probes in a row before the server's tree is killed and restarted",
    )
    parser.add_argument(
        "--reload-timeout", type=float, default=600.0, help="seconds one model reload may take"
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between checks")
    parser.add_argument(
        "--prefill-model", default="prefill", help=f"the model whose {UNIT_PARAMETER} names the unit"
    )
    parser.add_argument(
        "--proxy", action="store_true", help="run the unit's tandem-proxy sidecar (the proxy KV path)"
    )
    parser.add_argument(
        "--mps",
        type=mps.parse_mode,
        default=mps.MpsMode.AUTO,
        help="CUDA MPS for engines sharing a GPU (serving/mps.py): off, auto (on where they share one "
        "and nvidia-cuda-mps-control exists), on (refuse to start without it)",
    )
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        own, server = argv[:i], argv[i + 1 :]
    else:
        own, server = argv, []
    opts = parser.parse_args(own)
    if not server:
        parser.error("give the tritonserver arguments after `--`")
    return opts, server


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
