"""Starts the real `tritonserver` (the console script of this environment) on free ports.

`TritonProcess` copies the checked-in `model_repository/` into a temporary directory, optionally
overriding `tandem.*` parameters per model, starts the server, and waits until every model is ready.
The launcher locks the server's control APIs with its unit's key (serving/api_key.py): a test that
loads, unloads or reconfigures passes `api_lock()`'s headers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import tritonclient.grpc as grpcclient

from tandem.serving import process_tree
from tandem.serving.api_key import ApiLock, resolve
from tandem.serving.repository import render
from tandem.wire.contract import Widths

REPO = Path(__file__).resolve().parents[2]
_SERVERS = itertools.count()  # each TritonProcess its own /dev/shm prefix


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare_repository(
    dest: Path,
    overrides: Mapping[str, Mapping[str, str]] | None = None,
    groups: Mapping[str, str] | None = None,
    dims: Widths | None = None,
) -> Path:
    return render(REPO / "model_repository", dest / "model_repository", overrides, groups, dims)


class TritonProcess:
    def __init__(
        self,
        workdir: Path,
        overrides: Mapping[str, Mapping[str, str]] | None = None,
        extra_args: Sequence[str] = (),
        groups: Mapping[str, str] | None = None,
        launcher: Sequence[str] = (),
        dims: Widths | None = None,
    ) -> None:
        """`extra_args` go to tritonserver after the defaults (e.g. `--model-control-mode=explicit`).
        `launcher`, if given, replaces this environment's `tritonserver` in front of the server's
        arguments (e.g. `tandem-unit --restart-grace 2 --`). `dims`: the widths every model's row and
        frame tensors take, for a model whose rows are not the checked-in tiny preset's
        (`serving.repository.tensor_dims`)."""
        self.workdir = workdir
        self.repo = prepare_repository(workdir, overrides, groups, dims)
        self.extra_args = tuple(extra_args)
        self.shm_prefix = f"tandem_test_{os.getpid()}_{next(_SERVERS)}_"
        self.launcher = tuple(launcher)
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = workdir / "tritonserver.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    def start(self, timeout_s: float = 600.0) -> TritonProcess:
        """Start the server and wait until it is ready. The bound is generous on purpose: on a
        shared 2-core CPU under other test runs, loading the seven models (seven stubs and four
        engine workers, each importing torch) has taken over 180 s."""
        binary = Path(sys.executable).parent / "tritonserver"  # the launcher `make setup` installs
        server = (str(binary),) if binary.exists() else (sys.executable, "-m", "tandem.serving.launcher")
        env = dict(os.environ)
        run_dir = self.workdir / "run"
        run_dir.mkdir(mode=0o700, exist_ok=True)
        env["XDG_RUNTIME_DIR"] = str(run_dir)  # a private transfer control dir per server
        env["XDG_STATE_HOME"] = str(self.workdir / "state")  # its own voice store, kept across restarts
        # A bare server's python-backend regions get a prefix of this process's own, so that `stop`
        # removes what a killed server or stub leaves (tandem-unit names and removes its own).
        own_prefix = (
            () if self.launcher else (f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",)
        )
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    *(self.launcher or server),
                    *own_prefix,
                    f"--model-repository={self.repo}",
                    f"--grpc-port={self.grpc_port}",
                    f"--http-port={self.http_port}",
                    f"--metrics-port={self.metrics_port}",
                    "--log-verbose=0",
                    *self.extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"tritonserver exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if client.is_server_ready():
                        return self
                except Exception:
                    pass
                time.sleep(0.5)
        except BaseException:
            # pytest-timeout's Failed (or a Ctrl-C) lands here while the server loads: without this
            # its whole tree outlives the test and loads the box for every test after it.
            self.stop()
            raise
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout_s} s:\n{self.log_tail()}")

    def api_lock(self) -> ApiLock:
        """The lock the launcher put on this server: the same key, read from the same unit directory
        (the server's XDG_RUNTIME_DIR, see `start`) or TANDEM_API_KEY_FILE."""
        env = {**os.environ, "XDG_RUNTIME_DIR": str(self.workdir / "run")}
        return resolve([f"--model-repository={self.repo}"], env)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """End the server's whole tree: SIGTERM to its group, SIGKILL 30 s later, then SIGKILL to
        every process that was below it (a supervised server runs in a session of its own, and
        stubs and workers can outlive a server that died)."""
        if self.proc is None:
            return
        tree = process_tree.descendants(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        process_tree.kill_all(tree)
        if not self.launcher:  # what a killed server or stub left in /dev/shm
            for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
                with contextlib.suppress(FileNotFoundError):
                    region.unlink()
