"""The unit's CUDA MPS control daemon: one GPU shared by several engine processes without time-slicing.

P, D, the vocoder (and `tts_mono`, the registrar) are separate processes; placed on one GPU, each has
a CUDA context of its own, and the GPU time-slices between contexts: a context's kernels wait out
another's slice even when the GPU has room for both. Measured on one H200 (docs/benchmarks/README.md,
Orpheus unit): D's fixed step cost fell from 3.2-4.3 ms to 1.9 ms under MPS, which runs the contexts'
kernels side by side through one server.

`tandem-unit --mps off|auto|on` (serving/supervisor.py) decides with `plan` and, when on, runs an
`MpsDaemon` for as long as it runs:
- off: never.
- auto (the default): on when some GPU holds two or more engine instances (the repositories'
  `KIND_GPU` instance groups) and `nvidia-cuda-mps-control` is on PATH; a CPU repository, one engine per
  GPU, or no binary: off (said in the log). A daemon that fails to start is then logged and the
  unit serves without it.
- on: as auto where the GPUs are shared, and MPS must run: no binary, or a daemon that does not
  start, is an `MpsError` naming the cause (the unit does not start).

The daemon is the unit's own: its pipe and log directories lie under the unit's directory
(`<unit dir>/mps/pipe`, `<unit dir>/mps/log`), passed to tritonserver (and so to its stubs and engine
workers) as CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY, so two units of one host, or a system-wide
daemon, never meet. `stop` sends `quit` through the same pipe directory, waits for the daemon to go
and removes both directories; `start` first stops a daemon a killed supervisor of this unit left (the
unit's lock proves that supervisor is gone).
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
QUIT_WAIT_S = 10.0
START_WAIT_S = 5.0  # `quit` waits for the MPS server's clients; ours are gone by then
_GROUP = re.compile(r"\{\s*kind:\s*KIND_GPU\s*(?:count:\s*(\d+)\s*)?gpus:\s*\[([^\]]*)\]")
_GROUPS = re.compile(r"instance_group\s*\[(.*?)\]\s*$", re.MULTILINE | re.DOTALL)


class MpsMode(enum.IntEnum):
    OFF = 0
    AUTO = 1
    ON = 2


class MpsError(RuntimeError):
    """MPS was asked for (`--mps on`) and cannot run here; the message names why."""


def parse_mode(text: str) -> MpsMode:
    try:
        return MpsMode[text.upper()]
    except KeyError:
        raise ValueError(f"--mps wants off, auto or on, got {text!r}") from None


def engines_per_gpu(repositories: Sequence[Path]) -> dict[int, list[str]]:
    """GPU id -> the model instances placed on it (one name per instance), from every model's
    `KIND_GPU` instance groups (`gpus: [...]`, `count` instances on each listed GPU)."""
    out: dict[int, list[str]] = {}
    for repo in repositories:
        for config in sorted(Path(repo).glob("*/config.pbtxt")):
            text = config.read_text()
            for block in _GROUPS.findall(text):
                for count, gpus in _GROUP.findall(block):
                    for gpu in (int(g) for g in gpus.replace(",", " ").split()):
                        out.setdefault(gpu, []).extend([config.parent.name] * int(count or 1))
    return out


@dataclass(frozen=True)
class MpsPlan:
    """Whether the unit runs its MPS daemon, and why (logged at start)."""

    run: bool
    reason: str


def plan(
    mode: MpsMode, repositories: Sequence[Path], which: Callable[[str], str | None] = shutil.which
) -> MpsPlan:
    """The decision for `mode` over the served `repositories`; MpsError where `on` cannot run.
    `which` finds the control binary (shutil.which; tests pass their own PATH)."""
    if mode == MpsMode.OFF:
        return MpsPlan(False, "MPS off (--mps off)")
    shared = {g: names for g, names in engines_per_gpu(repositories).items() if len(names) > 1}
    binary = which(CONTROL)
    if mode == MpsMode.ON and binary is None:
        raise MpsError(f"--mps on, but {CONTROL} is not on PATH (the CUDA toolkit's MPS control daemon)")
    if not shared:
        return MpsPlan(False, "MPS off: no GPU holds two engine instances")
    where = "; ".join(f"GPU {g}: {', '.join(names)}" for g, names in sorted(shared.items()))
    if binary is None:
        return MpsPlan(False, f"MPS off: {CONTROL} not on PATH, so the engines time-slice ({where})")
    return MpsPlan(True, f"MPS on: engines share a GPU ({where})")


class MpsDaemon:
    """One unit's MPS control daemon under `root` (`<unit dir>/mps`). Not thread-safe: the
    supervisor's main thread starts and stops it."""

    def __init__(self, root: Path, binary: str = CONTROL) -> None:
        self.root = root
        self.pipe = root / "pipe"
        self.log = root / "log"
        self.binary = binary
        self.running = False

    def env(self) -> dict[str, str]:
        """What every client (tritonserver and its children) and the control binary must see."""
        return {PIPE_ENV: str(self.pipe), LOG_ENV: str(self.log)}

    def _control(self, command: str | None, timeout_s: float) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env()}
        argv = [self.binary] + ([] if command is not None else ["-d"])
        return subprocess.run(
            argv, input=command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )

    def start(self) -> None:
        """Start the daemon (stopping one a killed supervisor left first); MpsError naming the cause
        (with the daemon's log tail) when it does not start or does not answer."""
        self.stop()
        self.pipe.mkdir(parents=True, mode=0o700)
        self.log.mkdir(parents=True, mode=0o700)
        try:
            started = self._control(None, 30.0)
            answer = started
            # The daemon forks and returns; a query through its pipe proves it serves (retried for
            # START_WAIT_S: the forked daemon may not have opened its pipe yet).
            deadline = time.monotonic() + START_WAIT_S
            while started.returncode == 0:
                answer = self._control("get_server_list", 30.0)
                if answer.returncode == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self._remove()
            raise MpsError(f"{self.binary} -d could not run: {exc}") from exc
        if started.returncode != 0 or answer.returncode != 0:
            why = (answer.stderr or answer.stdout).strip() or f"status {answer.returncode}"
            tail = self._log_tail()
            self.running = True  # whatever did start goes with stop()
            self.stop()
            raise MpsError(f"the MPS control daemon did not start ({why}){tail}")
        self.running = True

    def stop(self) -> None:
        """Quit the daemon (if one answers in our pipe directory), wait for it, remove both
        directories. Never raises: a daemon that will not quit is logged by the caller's next start."""
        if self.pipe.exists():
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self._control("quit", QUIT_WAIT_S)
            deadline = time.monotonic() + QUIT_WAIT_S
            # The daemon removes its control pipe as it exits.
            while (self.pipe / "control").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        self._remove()
        self.running = False

    def _log_tail(self) -> str:
        log = self.log / "control.log"
        try:
            lines = log.read_text(errors="replace").strip().splitlines()[-5:]
        except OSError:
            return ""
        return f"; {log}: " + " | ".join(lines) if lines else ""

    def _remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def open_daemon(
    mode: MpsMode, repositories: Sequence[Path], unit_dir: Path, log: Callable[[str], None]
) -> MpsDaemon | None:
    """The unit's running daemon, or None where the plan says off (logged) or, under auto, where it
    did not start (logged: the engines then time-slice). MpsError under `on` when it cannot run."""
    decision = plan(mode, repositories)
    if not decision.run:
        log(decision.reason)
        return None
    daemon = MpsDaemon(unit_dir / "mps", shutil.which(CONTROL) or CONTROL)
    try:
        daemon.start()
    except MpsError as exc:
        if mode == MpsMode.ON:
            raise
        log(f"{exc}: serving without MPS, the engines time-slice their GPU")
        return None
    log(f"{decision.reason}; control daemon with pipes in {daemon.pipe}")
    return daemon


def server_env(env: Mapping[str, str], daemon: MpsDaemon | None) -> dict[str, str]:
    """tritonserver's environment: `env` plus the daemon's directories when it runs."""
    out = dict(env)
    if daemon is not None and daemon.running:
        out.update(daemon.env())
    return out
