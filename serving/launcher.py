"""`tritonserver` console script: runs the real Triton server binary.

Two places carry a real binary:
- the NGC tritonserver image (`/opt/tritonserver/bin/tritonserver`), used unchanged;
- the `nvidia-pytriton` wheel (tritonserver 2.51.0 + python backend), which needs three things
  the wheel does not arrange by itself (README, "The server binary"): the backend stub built for the running
  Python inside the python backend folder, the wheel's bundled libraries on LD_LIBRARY_PATH, and
  the virtualenv's `bin` first on PATH so the stub's interpreter imports this environment's
  packages (numpy, torch, tandem).

This launcher prepares those and `exec`s the binary, so signals and the exit status are the
server's own. It never falls back to anything that is not a real tritonserver.

Whichever binary runs, the launcher locks Triton's control APIs (model repository, shared memory,
logging, trace, statistics) with the unit's API key (`serving/api_key.py`, docs/security.md): it adds
`--http-restricted-api` and `--grpc-restricted-protocol` to the caller's arguments. `TANDEM_API_LOCK=off`
leaves them open and prints a warning at every start; `TANDEM_API_KEY_FILE` takes the key from a file
(a mounted Secret) instead of the one generated in the unit's directory.

On a machine with no NVIDIA device (`/dev/nvidiactl` absent) the launcher says so in one line and
starts the server in CPU mode: no pinned memory pool, no CUDA pool, no GPU metrics (the flags it
adds unless the caller gave them), so Triton probes no CUDA driver and no NVML; the CUDA error lines
Triton still writes on such a machine for nothing wrong (`CudaDriverHelper has not been
initialized.` at start, `unable to create stream for tts: CUDA driver version is insufficient ...`
when the ensemble loads; `CPU_NOISE`) are dropped from its stderr: by a filter process here
(`_drop_lines`), by a relay thread under tandem-unit (`relay_lines`).

The server runs under umask 077 (here before the exec, in `tandem-unit` before its start), so that the
python backend's `/dev/shm` regions, which carry request tensors, are mode 0600.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from tandem.serving.api_key import UNLOCKED_WARNING, ApiKeyError, resolve

NGC_BINARY = Path("/opt/tritonserver/bin/tritonserver")


class LauncherError(RuntimeError):
    pass


def _pytriton_root() -> Path:
    # find_spec locates the wheel without importing pytriton (whose __init__ pulls in its client stack).
    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise LauncherError(
            "no tritonserver found: install the server extra (`pip install tandem-tts[server]`, "
            "which brings nvidia-pytriton==0.7.0) or run inside the NGC tritonserver image"
        )
    return Path(spec.origin).resolve().parent / "tritonserver"


def prepare_backend_dir(root: Path, prefix: Path) -> Path:
    """Build `<prefix>/var/tandem/backends/python` holding the python backend and this Python's stub.

    The stub must match the interpreter (`python_backend_stubs/<major.minor>/`); the backend library
    and its utils module are linked, not copied, so upgrading the wheel updates them.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise LauncherError(f"nvidia-pytriton carries no python backend stub for Python {version}: {stub}")
    backends = prefix / "var" / "tandem" / "backends"
    python_dir = backends / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    src_python = root / "backends" / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        link = python_dir / name
        if not link.exists():
            link.symlink_to(src_python / name)
    target = python_dir / "triton_python_backend_stub"
    if not target.exists() or target.stat().st_size != stub.stat().st_size:
        tmp = target.with_suffix(".tmp")
        shutil.copy2(stub, tmp)
        os.replace(tmp, target)
    return backends


def locked(argv: list[str], env: Mapping[str, str]) -> list[str]:
    """`argv` plus the flags that lock the control APIs with the unit's key (generated on first start),
    or `argv` as it is, with a warning on stderr, under `TANDEM_API_LOCK=off`."""
    try:
        lock = resolve(argv, env)
    except ApiKeyError as exc:
        raise LauncherError(f"cannot lock the control APIs: {exc}") from exc
    if not lock.locked:
        print(f"tritonserver launcher: WARNING: {UNLOCKED_WARNING}", file=sys.stderr, flush=True)
    return [*argv, *lock.server_args()]


CPU_FLAGS = (
    "--pinned-memory-pool-byte-size=0",
    "--cuda-memory-pool-byte-size=0:0",
    "--allow-gpu-metrics=false",
)
# Triton's error lines on every CPU machine, for nothing wrong: at start, and when an ensemble
# (`tts`) loads and asks for a CUDA stream it never uses there. Dropped only where no NVIDIA device is.
CPU_NOISE = (
    b"CudaDriverHelper has not been initialized.",
    b"CUDA driver version is insufficient for CUDA runtime version",
)
CPU_MODE_LINE = "CPU mode (no NVIDIA device): no pinned memory, CUDA pool or GPU metrics"


def cpu_machine(dev: Path = Path("/dev")) -> bool:
    """No NVIDIA device node: nothing CUDA can use."""
    return not (dev / "nvidiactl").exists()


def with_cpu_mode(argv: list[str]) -> list[str]:
    """`argv` with `CPU_FLAGS` added where the caller did not set that option."""
    given = {a.split("=", 1)[0] for a in argv}
    return [*argv, *(f for f in CPU_FLAGS if f.split("=", 1)[0] not in given)]


def _drop_lines(fd: int, drop: tuple[bytes, ...]) -> None:
    """Route `fd` through a child process that copies every line but those holding one of `drop`.
    The child ignores SIGINT/SIGTERM (the server's shutdown lines still pass) and ends at EOF,
    when the server's last copy of the pipe closes."""
    r, w = os.pipe()
    if os.fork() == 0:  # the filter
        os.close(w)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with os.fdopen(r, "rb", buffering=0) as src:
            for line in src:
                if not any(d in line for d in drop):
                    os.write(fd, line)
        os._exit(0)
    os.close(r)
    os.dup2(w, fd)
    os.close(w)


def drop_cpu_noise() -> None:
    """In the process about to exec the server: its stderr without `CPU_NOISE` (`_drop_lines`)."""
    _drop_lines(2, CPU_NOISE)


def relay_lines(src: BinaryIO, dst: BinaryIO, drop: tuple[bytes, ...]) -> None:
    """Copy `src`'s lines to `dst` but those holding one of `drop`, until EOF (tandem-unit's thread
    for its server's stderr: the supervisor outlives the server, so no line is lost)."""
    with src:
        for line in src:
            if not any(d in line for d in drop):
                dst.write(line)
                dst.flush()


def _libpython_dir() -> str:
    """The running Python's own libpython directory ("" when it has none there, a static build):
    the stub links libpython by its soname, and without this the loader may pick the system's copy
    of that version while the stub imports the running Python's extension modules, which can need
    symbols only its own libpython has (seen: pyenv's 3.11.7 `_ssl` against Debian's 3.11, so any
    stub that imports `ssl`, e.g. through transformers for Mimi, failed to load)."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return str(libdir)
    return ""


def build_command(argv: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """Return (binary, argv, env) for the real server; the argv carries the API lock (see `locked`),
    so the returned argv holds the key: never print it unredacted (`ApiLock.redact`)."""
    env = dict(os.environ)
    argv = locked(argv, env)
    if cpu_machine():
        argv = with_cpu_mode(argv)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    explicit = env.get("TANDEM_TRITONSERVER_BINARY")
    if explicit:
        return explicit, [explicit, *argv], env
    if NGC_BINARY.is_file():
        return str(NGC_BINARY), [str(NGC_BINARY), *argv], env
    root = _pytriton_root()
    binary = root / "bin" / "tritonserver"
    libs = root.parent.parent / "nvidia_pytriton.libs"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p
        for p in (str(libs), str(root / "external_libs"), _libpython_dir(), env.get("LD_LIBRARY_PATH", ""))
        if p
    )
    args = list(argv)
    if not any(a.startswith("--backend-directory") for a in args):
        args.append(f"--backend-directory={prepare_backend_dir(root, Path(sys.prefix))}")
    return str(binary), [str(binary), *args], env


def main() -> None:
    try:
        binary, args, env = build_command(sys.argv[1:])
    except LauncherError as exc:
        print(f"tritonserver launcher: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    os.umask(0o077)  # the server's files and /dev/shm regions are its user's alone (docs/security.md)
    if cpu_machine():
        print(f"tritonserver launcher: {CPU_MODE_LINE}", file=sys.stderr, flush=True)
        drop_cpu_noise()
    os.execve(binary, args, env)


if __name__ == "__main__":
    main()
