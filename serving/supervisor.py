"""`tandem-unit`: runs one unit's tritonserver and restarts it when it dies or its engines stay down.

Each engine (P, D, the monolithic engine) runs in a worker process that its model's stub starts and
restarts itself (serving/engine_worker.py, docs/failure-semantics.md "Engines in processes of their
own"): a dead or stalled engine never needs this supervisor. What is left here is the server itself:

* starts the real server through the launcher (`tandem.serving.launcher.build_command`), adding
  `--model-control-mode=explicit --load-model=*` unless a model-control mode is given;
* reads the engines' truth from the server's metrics (`tandem.serving.health`: `tandem_engine_up`,
  `tandem_draining`) every `--poll-interval`, logs each engine that goes down or comes back, and
  restarts the server when some engine has been down for `--engine-down-grace` seconds (its stub's
  own restarts did not bring it back: a broken device, a start that keeps failing);
* forwards SIGTERM/SIGINT to the server (a second one kills it) and exits with its status; restarts
  a server that exits unexpectedly, at most `--max-server-restarts` times a minute, then exits non-zero
  so that the pod's supervisor takes over;
* with `--proxy`, runs the unit's IPC proxy sidecar (`tandem-proxy`, for the `proxy` KV path) before
  the server and for as long as it runs. A proxy that exits takes every P and D registration with it
  (D's arena, P's staging: they are not re-made), so the supervisor starts a new proxy and then
  restarts the server, whose P and D register again; every stream of the unit fails meanwhile.
* sends the unit's API key (`serving/api_key.py`) on its own calls to the server: the launcher locks
  Triton's model-repository API (and the other control APIs) with it, so the `prefill` load needs it.

It imports neither torch nor Triton, and keeps running when the model code cannot import.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from tandem.serving.api_key import DEFAULT_UNIT, UNIT_PARAMETER, ApiKeyError, resolve
from tandem.serving.health import HealthUnavailable, UnitHealth, fetch_health
from tandem.serving.launcher import LauncherError, build_command
from tandem.serving.repository import model_parameter

RESTART_WINDOW_S = 60.0
_PR_SET_PDEATHSIG = 1


def log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} tandem-unit: {msg}", file=sys.stderr, flush=True)


# ---- the server's arguments ----------------------------------------------------------------------


def option_values(args: Sequence[str], *names: str) -> list[str]:
    """Every value of `--name=value` / `--name value` in `args`, in order."""
    out = []
    for i, arg in enumerate(args):
        for name in names:
            if arg.startswith(name + "="):
                out.append(arg[len(name) + 1 :])
            elif arg == name and i + 1 < len(args):
                out.append(args[i + 1])
    return out


def with_explicit_control(args: Sequence[str]) -> list[str]:
    """`args` plus `--model-control-mode=explicit --load-model=*` unless a model-control mode is given."""
    if option_values(args, "--model-control-mode"):
        return list(args)
    return [*args, "--model-control-mode=explicit", "--load-model=*"]


def http_base(args: Sequence[str]) -> str:
    port = (option_values(args, "--http-port") or ["8000"])[-1]
    host = (option_values(args, "--http-address") or ["127.0.0.1"])[-1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}"


def metrics_url(args: Sequence[str]) -> str:
    """The server's Prometheus endpoint, where the engines publish `tandem_engine_up`."""
    port = (option_values(args, "--metrics-port") or ["8002"])[-1]
    host = (option_values(args, "--metrics-address") or ["127.0.0.1"])[-1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://{host}:{port}/metrics"


def find_model_dir(args: Sequence[str], model: str) -> Path | None:
    """`<repository>/<model>` for the first local repository (of the server's args) that holds `model`."""
    for repo in option_values(args, "--model-repository", "--model-store"):
        candidate = Path(repo) / model
        if (candidate / "config.pbtxt").is_file():
            return candidate
    return None


# ---- the supervisor ------------------------------------------------------------------------------


class GiveUp(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def exit_status(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _die_with_parent_fn() -> Callable[[], None] | None:
    """A preexec_fn that has the kernel SIGTERM the server if the supervisor dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os._exit(1)

    return preexec


class Supervisor:
    def __init__(self, opts: argparse.Namespace, server_args: Sequence[str]) -> None:
        self.opts = opts
        self.model: str = opts.prefill_model
        self.args = with_explicit_control(server_args)
        self.api = resolve(self.args)  # the key the launcher locks the server with (serving/api_key.py)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.stop_deadline = float("inf")
        self.restarts: collections.deque[float] = collections.deque()
        self.starts = 0
        self.ever_up = False
        # per server lifetime (reset by start_server)
        self.health: UnitHealth | None = None  # the last reading of the engines
        self.down_since: float | None = None  # some engine down since (monotonic)
        self.proxy: subprocess.Popen[str] | None = None
        self.proxy_starts = 0
        self.metrics_url = metrics_url(self.args)
        self.unit = DEFAULT_UNIT
        model_dir = find_model_dir(self.args, self.model)
        if model_dir is not None:
            self.unit = model_parameter(model_dir.parent, self.model, UNIT_PARAMETER) or DEFAULT_UNIT
        log(f"unit {self.unit!r}: engines' health from {self.metrics_url}")

    # ---- the IPC proxy sidecar (--proxy) -----------------------------------------------------------

    def start_proxy(self) -> None:
        """Start `tandem-proxy` for this unit and wait for its ready line (GiveUp if it never comes)."""
        argv = [sys.executable, "-m", "tandem.transfer.proxy", "--unit", self.unit]
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
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            argv, executable=binary, env=env, start_new_session=True, preexec_fn=_die_with_parent_fn()
        )
        self.starts += 1
        self.health = None
        self.down_since = None
        log(f"started tritonserver (pid {self.proc.pid}): {self.api.redact(' '.join(argv[1:]))}")

    def stop_server(self, timeout_s: float) -> int:
        proc = self.proc
        assert proc is not None
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
        """SIGKILL what is left of an exited server's process group: its stubs outlive a killed server
        (an orphaned P keeps its slot lock, and the next server's P could not start) and a server that
        gave up waiting on them at its exit timeout."""
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        log(f"killing the leftover processes of tritonserver {self.proc.pid} (its stubs)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill_server(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and its stubs (one session)

    def restart_server(self, reason: str) -> None:
        """Stop (if still running) and start the server again, within the restart budget."""
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
        self.stop_server(self.opts.stop_timeout)
        if not self.stopping:
            self.start_server()

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.proc is None or self.proc.poll() is not None:
            self.stopping = True
            return
        if self.stopping:
            log(f"{name} again: killing tritonserver")
            self.kill_server()
            return
        self.stopping = True
        self.stop_deadline = time.monotonic() + self.opts.stop_timeout
        log(f"{name}: forwarding it to tritonserver (pid {self.proc.pid})")
        self.proc.send_signal(signum)

    # ---- the engines ------------------------------------------------------------------------------

    def check_engines(self) -> None:
        """Read the engines' health; log what changed; restart the server after `--engine-down-grace`
        seconds with some engine down (its stub's own restarts have not brought it back)."""
        try:
            health = fetch_health(self.metrics_url, timeout_s=2.0)
        except HealthUnavailable:
            return  # starting, or between scrapes of a busy server: the process check covers death
        self.ever_up = True
        if not health.engines:
            return  # the models are still loading: no engine has published yet
        before = {(e.model, e.model_instance): e for e in self.health.engines} if self.health else {}
        for e in health.engines:
            old = before.get((e.model, e.model_instance))
            if old is None and e.up:
                log(f"{e.model} {e.model_instance}: engine up")
            elif (old is None or old.up) and not e.up:
                log(f"{e.model} {e.model_instance}: engine down (tandem_engine_up 0); its stub restarts it")
            elif old is not None and not old.up and e.up:
                log(f"{e.model} {e.model_instance}: engine up again")
            if old is not None and old.draining != e.draining:
                log(f"{e.model} {e.model_instance}: {'draining' if e.draining else 'no longer draining'}")
        self.health = health
        now = time.monotonic()
        if health.engines_up:
            self.down_since = None
            return
        self.down_since = self.down_since or now
        if now - self.down_since >= self.opts.engine_down_grace:
            down = "; ".join(r for r in health.reasons if r.endswith("engine down"))
            self.restart_server(f"engines down for {now - self.down_since:.0f} s: {down}")

    # ---- main loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        try:
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
                        log(f"tritonserver exited with status {rc}")
                        self.reap_leftovers()
                        return exit_status(rc)
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
                    self.check_engines()
                time.sleep(self.opts.poll_interval)
        except GiveUp as give_up:
            if self.proc is not None and self.proc.poll() is None:  # e.g. a proxy that will not start
                self.stop_server(self.opts.stop_timeout)
            return give_up.status
        finally:
            self.stop_proxy()


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
        "--stop-timeout", type=float, default=45.0, help="seconds after SIGTERM before SIGKILL"
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between checks")
    parser.add_argument(
        "--prefill-model", default="prefill", help="the model whose tandem.transfer.unit names the unit"
    )
    parser.add_argument(
        "--proxy", action="store_true", help="run the unit's tandem-proxy sidecar (the proxy KV path)"
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
    raise SystemExit(supervisor.run())


if __name__ == "__main__":
    main()
