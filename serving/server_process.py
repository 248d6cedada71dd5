"""The unit's tritonserver process: start, stop, kill its whole tree, and probe its liveness.

Called by `tandem-unit`'s supervisor (serving/supervisor.py) on its main thread only (its signal
handler included). It owns:

* `ServerProcess`: the server's `Popen` (one at a time), how many were started, and every process
  seen in its tree (`watch_tree`, so that a kill reaches workers that left the server's group).
  The server starts through the launcher (`build_command`) in a session of its own, umask 077 (every
  file and /dev/shm region of it is its user's alone) and PR_SET_PDEATHSIG=SIGKILL: if the
  supervisor dies, the kernel kills the server, every client's connection breaks at once and each
  stub's watcher (serving/stub_guard.py) ends its stub. Before a start it removes the regions a
  previous server of the unit left (the unit's lock, serving/leftovers.py, proves they are
  its own); after an exit it kills what is left of the tree and removes them again.
* `ServerProbe`: `/v2/health/live` and a metrics scrape every `--probe-interval`, `--probe-timeout`
  each; failures count only once the server has answered in this lifetime (its models load first).
  `--probe-failures` in a row are a hung server (SIGSTOP, a deadlocked crash handler): `probe`
  returns why, and the supervisor kills the tree and restarts it.

Failure: a server that cannot be built a command (`LauncherError`) raises `GiveUp(2)`, the
supervisor's exit status; nothing here restarts anything on its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping

from tandem.serving import mps, process_tree
from tandem.serving.api_key import ApiLock
from tandem.serving.health import HealthUnavailable, fetch_health
from tandem.serving.launcher import (
    CPU_MODE_LINE,
    CPU_NOISE,
    LauncherError,
    build_command,
    cpu_machine,
    relay_lines,
)
from tandem.serving.leftovers import Regions, kill_leftovers

_PR_SET_PDEATHSIG = 1


class GiveUp(Exception):
    """The supervisor stops supervising and exits with `status` (the pod's supervisor takes over)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it (128 + N for death by signal N)."""
    return returncode if returncode >= 0 else 128 - returncode


def die_with_parent_fn(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
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
    die = die_with_parent_fn(signal.SIGKILL)

    def preexec() -> None:
        os.umask(0o077)
        if die is not None:
            die()

    return preexec


class ServerProcess:
    """One unit's tritonserver, started again and again over the supervisor's life."""

    def __init__(self, args: list[str], api: ApiLock, regions: Regions, log: Callable[[str], None]) -> None:
        self.args = args  # the server's arguments, complete (serving/server_args.py)
        self.api = api
        self.regions = regions
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.tree: list[int] = []  # every process seen below the current server

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, daemon: mps.MpsDaemon | None, env_extra: Mapping[str, str]) -> subprocess.Popen[bytes]:
        """Start a server (the previous one gone): the launcher's command and environment, the MPS
        daemon's pipe (`daemon`), then `env_extra`. GiveUp(2) if the launcher cannot build it."""
        try:
            binary, argv, env = build_command(self.args)
        except LauncherError as exc:
            self.log(f"launcher: {exc}")
            raise GiveUp(2) from exc
        env = mps.server_env(env, daemon)
        env.update(env_extra)
        self.regions.remove()  # a server of this unit killed before (we hold the unit's lock)
        cpu = cpu_machine()
        if cpu and self.starts == 0:
            self.log(CPU_MODE_LINE)
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
        self.tree = []
        self.log(f"started tritonserver (pid {self.proc.pid}): {self.api.redact(' '.join(argv[1:]))}")
        return self.proc

    def watch_tree(self) -> None:
        """Add the processes below the running server to its tree (a /proc scan)."""
        assert self.proc is not None
        self.tree = list({*self.tree, *process_tree.descendants(self.proc.pid)})

    def stop(self, timeout_s: float) -> int:
        """SIGTERM the server (it drains for `--exit-timeout-secs`), kill its tree `timeout_s` later
        if it is still running, then clean up after it; its exit code."""
        proc = self.proc
        assert proc is not None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.log(f"tritonserver did not exit {timeout_s:.0f} s after SIGTERM; killing it")
                self.kill()
                proc.wait()
        self.reap_leftovers()
        return proc.returncode

    def reap_leftovers(self) -> None:
        """SIGKILL what is left of an exited server (serving/leftovers.py), then remove its
        shared-memory regions; nothing while it runs."""
        if self.proc is None or self.proc.poll() is None:
            return
        kill_leftovers(self.proc.pid, self.tree, self.log)
        self.regions.remove()

    def kill(self) -> None:
        """SIGKILL the server's whole tree: its process group and every process seen below it."""
        if self.proc is not None and self.proc.poll() is None:
            self.watch_tree()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its stubs (one session)
            process_tree.kill_all(self.tree)


class ServerProbe:
    """The server's liveness, per server lifetime (`reset` at each start)."""

    def __init__(
        self,
        http: str,
        metrics_url: str,
        interval_s: float,
        timeout_s: float,
        failures: int,
        log: Callable[[str], None],
    ) -> None:
        self.http = http
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_failures = failures
        self.log = log
        self.reset()

    def reset(self) -> None:
        self.answered = False  # the server answered a probe in this lifetime: its models loaded
        self.failures = 0
        self.next_probe = time.monotonic()

    def probe(self) -> str | None:
        """Probe if one is due; why the server must be killed and restarted (it is hung), or None."""
        now = time.monotonic()
        if now < self.next_probe:
            return None
        self.next_probe = now + self.interval_s
        timeout = self.timeout_s
        try:
            with urllib.request.urlopen(self.http + "/v2/health/live", timeout=timeout) as resp:
                resp.read()
            fetch_health(self.metrics_url, timeout_s=timeout)
        except (urllib.error.URLError, OSError, ValueError, HealthUnavailable) as exc:
            if not self.answered:
                return None
            self.failures += 1
            self.log(f"liveness probe {self.failures}/{self.max_failures} failed: {exc}")
            if self.failures >= self.max_failures:
                return f"it did not answer {self.failures} liveness probes in a row"
            return None
        if self.failures:
            self.log(f"tritonserver answers again after {self.failures} failed probes")
        self.answered = True
        self.failures = 0
        return None
