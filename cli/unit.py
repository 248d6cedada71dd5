"""`tandem-unit`: runs one unit's tritonserver and brings its prefill (P) back when P dies.

Triton 2.51's python backend does not restart a dead decoupled stub (docs/failure-semantics.md, "Who
restarts P"): after P's stub dies — SIGKILL, OOM, or P's own `os._exit(70)` when it holds ABORT_ACKs it
cannot prove — every `tts` request fails with "Stub process 'prefill_0_0' is not healthy" while the
server and the model still report ready. This supervisor:

* starts the real server through the launcher (`tandem.cli.tritonserver.build_command`), adding
  `--model-control-mode=explicit --load-model=*` unless a model-control mode is given;
* watches P's slot locks, `p-<slot>.lock` in the unit's control dir (transfer/control.py): a live P
  holds its lock (flock) for its whole life, so a lock of this server's P (seen held, or whose
  `p-<slot>.sock` was bound since the server started) that is free while Triton reports `prefill`
  loaded means that P died. It is the same proof D uses to release a dead P's transfers;
* reloads P: bumps the mtime of `<repo>/prefill/<version>/model.py` (Triton rebuilds a loaded model's
  instances only when a file of its version directory changed) and `POST /v2/repository/models/
  prefill/load`. D's streams already decoding continue meanwhile; D accepts the new instance id.
  After `--max-reload-failures` failed reloads in a row it restarts the whole server;
* forwards SIGTERM/SIGINT to the server (a second one kills it) and exits with its status; restarts
  a server that exits unexpectedly, at most `--max-server-restarts` times a minute, then exits non-zero
  so that the pod's supervisor takes over;
* with `--proxy`, runs the unit's IPC proxy sidecar (`tandem-proxy`, for the `proxy` KV path) before
  the server and for as long as it runs. A proxy that exits takes every P and D registration with it
  (D's arena, P's staging: they are not re-made), so the supervisor starts a new proxy and then
  restarts the server, whose P and D register again; every stream of the unit fails meanwhile.
* sends the unit's API key (`serving/api_key.py`) on its own calls to the server: the launcher locks
  Triton's model-repository API (and the other control APIs) with it, so the `prefill` load needs it.

The lock probe and the control-dir path mirror `tandem.transfer.control` (`instance_gone`,
`control_dir`) instead of importing it: importing `tandem.transfer` loads torch, and the supervisor must
stay small and keep running when the model code cannot import.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from tandem.cli.tritonserver import LauncherError, build_command
from tandem.serving.api_key import ApiKeyError, resolve
from tandem.serving.repository import model_parameter

UNIT_PARAMETER = "tandem.transfer.unit"
DEFAULT_UNIT = "default"  # backend/settings.py TransferSettings.unit
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


def find_model_dir(args: Sequence[str], model: str) -> Path | None:
    """`<repository>/<model>` for the first local repository (of the server's args) that holds `model`."""
    for repo in option_values(args, "--model-repository", "--model-store"):
        candidate = Path(repo) / model
        if (candidate / "config.pbtxt").is_file():
            return candidate
    return None


# ---- P's slot locks (mirrors tandem.transfer.control) --------------------------------------------


def control_dir_path(unit: str) -> Path:
    """Where `tandem.transfer.control.control_dir(unit)` lives; not created here."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"tandem-{os.getuid()}-{unit}"


def lock_is_free(path: Path) -> bool | None:
    """True if no process holds the flock on `path` (taken shared for an instant, as D does), False if
    one does, None if the file cannot be opened (a missing file proves nothing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # drops the shared lock if we got it
    return True


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
        self.base = http_base(self.args)
        self.api = resolve(self.args)  # the key the launcher locks the server with (serving/api_key.py)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.stop_deadline = float("inf")
        self.restarts: collections.deque[float] = collections.deque()
        self.starts = 0
        self.ever_up = False
        self.p_restarts = 0
        # per server lifetime (reset by start_server)
        self.known: set[Path] = set()
        self.dead_since: float | None = None
        self.failures = 0
        self.ready_since: float | None = None
        self.warned_no_lock = False
        self.started_at = float("inf")  # wall clock of the current server's start
        self.proxy: subprocess.Popen[str] | None = None
        self.proxy_starts = 0

        self.model_dir = find_model_dir(self.args, self.model)
        self.lock_dir: Path | None = None
        modes = option_values(self.args, "--model-control-mode")
        if modes and modes[-1] != "explicit":
            log(f"--model-control-mode={modes[-1]}: P cannot be reloaded; a dead P costs a server restart")
        self.unit = DEFAULT_UNIT
        if self.model_dir is None:
            log(f"no local repository holds {self.model!r}: watching the server process only")
        else:
            unit = model_parameter(self.model_dir.parent, self.model, UNIT_PARAMETER) or DEFAULT_UNIT
            self.unit = unit
            self.lock_dir = control_dir_path(unit)
            log(f"watching {self.model} of unit {unit!r}: slot locks {self.lock_dir}/p-{self.model}_*.lock")

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
        self.known.clear()
        self.dead_since = None
        self.failures = 0
        self.ready_since = None
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

    # ---- HTTP ---------------------------------------------------------------------------------------

    def http(self, method: str, path: str, timeout_s: float) -> tuple[int, str]:
        """(status, body) of one request to the server's HTTP endpoint; status 0 if it did not answer."""
        req = urllib.request.Request(
            self.base + path,
            method=method,
            data=b"{}" if method == "POST" else None,
            headers=self.api.http_headers(),  # repository calls are locked to the unit's key
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            return 0, str(exc)

    # ---- P ------------------------------------------------------------------------------------------

    def slot_locks(self) -> tuple[set[Path], set[Path]]:
        """(held, free) among P's slot lock files."""
        held: set[Path] = set()
        free: set[Path] = set()
        if self.lock_dir is None:
            return held, free
        try:
            paths = sorted(self.lock_dir.glob(f"p-{self.model}_*.lock"))
        except OSError:
            return held, free
        for path in paths:
            state = lock_is_free(path)
            if state is True:
                free.add(path)
            elif state is False:
                held.add(path)
        return held, free

    def bound_since_start(self, lock: Path) -> bool:
        try:
            return lock.with_suffix(".sock").stat().st_mtime >= self.started_at
        except OSError:
            return False

    def check_prefill(self) -> None:
        if self.lock_dir is None:
            return
        status, _ = self.http("GET", f"/v2/models/{self.model}/ready", 5.0)
        if status:
            self.ever_up = True
        if status != 200:
            self.dead_since = None
            self.ready_since = None
            return
        now = time.monotonic()
        self.ready_since = self.ready_since or now
        held, free = self.slot_locks()
        # A P of this server holds its lock (seen held), or held it and died before we looked: it bound
        # its control socket after taking the lock, so that socket is newer than the server. A lock file
        # left by an earlier configuration has neither and is never taken for a dead P.
        self.known |= held | {lock for lock in free if self.bound_since_start(lock)}
        if not self.known and not self.warned_no_lock and now - self.ready_since > 30:
            self.warned_no_lock = True
            log(
                f"{self.model} is loaded but no P holds a slot lock in {self.lock_dir}: "
                "dead-P detection is off"
            )
        dead = sorted(self.known & free)
        if not dead:
            if self.dead_since is not None:
                log(f"{self.model}'s slot locks are held again; no restart needed")
            self.dead_since = None
            return
        names = ", ".join(p.name for p in dead)
        if self.dead_since is None:
            self.dead_since = now
            log(
                f"P died: slot lock {names} is free while Triton reports {self.model} loaded; "
                f"restarting it in {self.opts.restart_grace:g} s"
            )
            return
        if now - self.dead_since >= self.opts.restart_grace:
            self.reload_prefill(dead)

    def version_files(self) -> list[Path]:
        assert self.model_dir is not None
        versions = [v for v in self.model_dir.iterdir() if v.is_dir() and v.name.isdigit()]
        files = [v / "model.py" for v in versions if (v / "model.py").is_file()]
        return files or [f for v in versions for f in v.iterdir() if f.is_file()]

    def reload_prefill(self, dead: list[Path]) -> None:
        self.p_restarts += 1
        n = self.p_restarts
        names = ", ".join(p.name for p in dead)
        now = time.time()
        touched = self.version_files()
        for f in touched:
            os.utime(f, (now, now))
        log(
            f"restarting P (#{n}): slot lock {names} free while {self.model} is loaded (P died); "
            f"bumped the mtime of {', '.join(map(str, touched))} so that Triton rebuilds the instances; "
            f"POST /v2/repository/models/{self.model}/load"
        )
        t0 = time.monotonic()
        status, body = self.http("POST", f"/v2/repository/models/{self.model}/load", self.opts.load_timeout)
        error = None if status == 200 else f"load answered {status or 'nothing'}: {body.strip()[:300]}"
        if error is None:
            deadline = time.monotonic() + 15.0
            while not self.stopping:
                held, _ = self.slot_locks()
                if set(dead) <= held:
                    break
                if time.monotonic() > deadline:
                    error = f"{self.model} loaded but no new P took {names}"
                    break
                time.sleep(0.1)
        if self.stopping:
            return
        if error is None:
            log(
                f"P restarted (#{n}): {self.model} reloaded in {time.monotonic() - t0:.1f} s; "
                f"a new P holds {names}"
            )
            self.failures = 0
            self.dead_since = None
            return
        self.failures += 1
        self.dead_since = time.monotonic()  # wait the grace again before the next attempt
        log(f"P restart #{n} failed ({self.failures} in a row): {error}")
        if self.failures >= self.opts.max_reload_failures:
            self.restart_server(f"{self.failures} P reloads failed in a row")

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
                    self.check_prefill()
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
        description="Run one unit's tritonserver and reload its prefill model when P dies.",
    )
    parser.add_argument(
        "--restart-grace", type=float, default=2.0, help="seconds P must stay dead before a reload"
    )
    parser.add_argument(
        "--max-reload-failures", type=int, default=3, help="failed reloads in a row that restart the server"
    )
    parser.add_argument(
        "--max-server-restarts", type=int, default=3, help="server restarts per minute before giving up"
    )
    parser.add_argument(
        "--stop-timeout", type=float, default=45.0, help="seconds after SIGTERM before SIGKILL"
    )
    parser.add_argument("--load-timeout", type=float, default=300.0, help="seconds one model load may take")
    parser.add_argument("--poll-interval", type=float, default=0.5, help="seconds between checks")
    parser.add_argument("--prefill-model", default="prefill", help="the P model's name in the repository")
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
