"""The control plane's OS plumbing: private socket directory, instance lock, peer credentials.

Naming: P's socket is `control_dir(unit)/p-<slot>.sock`, where `slot` is the P's stable name inside the
unit (e.g. the Triton model instance "prefill_0"). A restarted P binds the same path, so a D that keeps
probing the address meets the new process and sees its new random instance id.

Instance lock (`p-<slot>.lock`, flock LOCK_EX): a P takes it before it binds or accepts anything and
gives it up only when its process exits or `TransferSender.close()` has seen every copy finish. Hence
(a) a new instance at the endpoint proves the old one can no longer write (it had to let go of the lock
first), and (b) a lock that D can take itself proves no P instance of that slot is alive — the
process-death proof. The lock file is never unlinked: unlinking would let two processes lock two inodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import stat
import struct
from collections.abc import Mapping
from pathlib import Path

from .errors import TransferError, UnsafeControlDir

# The unit: one P/D pair's scope (its control directory, sockets, locks and proxy). Its name comes from
# the `UNIT_PARAMETER` of a model's config.pbtxt (backend/settings.py `TransferSettings.unit`); a
# server whose models name none serves `DEFAULT_UNIT` unless its repository gives it one
# (serving/repository.py `repository_unit`).
UNIT_PARAMETER = "tandem.transfer.unit"
DEFAULT_UNIT = "default"

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SUN_PATH_MAX = 107


def _check_name(kind: str, name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"{kind} {name!r} must match {_NAME.pattern}")


def control_dir(unit: str, env: Mapping[str, str] | None = None) -> Path:
    """The unit's private control directory, created 0700 if missing.

    Called once by each sender and receiver at construction, and by the launcher and the supervisor
    (the unit's API key lives there) with the environment the server will run in (`env`, default this
    process's). Under $XDG_RUNTIME_DIR if set, else /tmp.
    Raises `UnsafeControlDir` if the path exists but is a symlink, not a directory, not owned by our
    uid, or not exactly mode 0700 — we never loosen or adopt someone else's directory.
    """
    _check_name("unit", unit)
    base = (os.environ if env is None else env).get("XDG_RUNTIME_DIR") or "/tmp"
    path = Path(base) / f"tandem-{os.getuid()}-{unit}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeControlDir(f"{path} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeControlDir(f"{path} is owned by uid {st.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UnsafeControlDir(f"{path} has mode {stat.S_IMODE(st.st_mode):o}, expected 700")
    return path


def endpoint_paths(unit: str, slot: str) -> tuple[Path, Path]:
    """(socket path, lock path) of the P in `slot` of `unit`."""
    _check_name("slot", slot)
    d = control_dir(unit)
    sock_path = d / f"p-{slot}.sock"
    if len(os.fsencode(sock_path)) > _SUN_PATH_MAX:
        raise TransferError(f"control socket path too long for AF_UNIX: {sock_path}")
    return sock_path, d / f"p-{slot}.lock"


class InstanceLock:
    """P's exclusive flock on its slot; held for the life of the sender (see module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    @property
    def fd(self) -> int:
        """The locked descriptor (to share with a process that writes for this P, see the proxy)."""
        if self._fd is None:
            raise TransferError("the instance lock is not held")
        return self._fd

    def release(self) -> None:
        """Only after every copy this instance started has finished (or by process exit)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def lock_held(path: str, open_flags: int = 0) -> bool:
    """Does some process hold an exclusive flock on the file at `path` right now? Probed through a
    new open file description with a shared lock taken for an instant (a P starting at that moment
    retries its exclusive lock). Raises OSError if `path` cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | open_flags)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if we got it
    return False


def instance_gone(lock_path: str) -> bool:
    """True only if no process holds the slot's instance lock right now (the process-death proof).

    Called by the receiver's maintenance thread when it cannot reach an endpoint. A missing lock file
    is *not* proof (a holder may keep an unlinked inode locked), so it returns False.
    """
    try:
        return not lock_held(lock_path)
    except OSError:
        return False


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def same_user(sock: socket.socket) -> bool:
    return peer_cred(sock)[1] == os.getuid()


def listen_unix(path: Path) -> socket.socket:
    """Bind and listen at `path`, replacing a stale socket file. Caller must hold the instance lock."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    srv.bind(os.fspath(path))
    os.chmod(path, 0o600)
    srv.listen(64)
    return srv


def connect_unix(path: str, timeout_s: float) -> socket.socket:
    """Connect to P's endpoint; raises OSError (ENOENT/ECONNREFUSED when nothing listens)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.settimeout(None)
    except OSError:
        sock.close()
        raise
    return sock


# ---- the control plane over TCP (cross-host; only with a path where D writes every byte) --------------

CONTROL_MAGIC = b"TKC1"  # P's control listener (the data listener's is paths.tcp.MAGIC)
CONTROL_ROLES = (b"P", b"D")  # (listener, connector) MAC roles of the control handshake
TCP_SCHEME = "tcp://"


def tcp_endpoint(host: str, port: int) -> str:
    """The ticket form of a TCP control endpoint (IPv6 literals in brackets)."""
    return f"{TCP_SCHEME}[{host}]:{port}" if ":" in host else f"{TCP_SCHEME}{host}:{port}"


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://host:port` endpoint; None for a unix socket path. Raises
    `TransferError` for a malformed tcp:// endpoint."""
    if not endpoint.startswith(TCP_SCHEME):
        return None
    rest = endpoint[len(TCP_SCHEME) :]
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TransferError(f"malformed control endpoint {endpoint!r} (want tcp://host:port)")
    return host, int(port)


def listen_tcp(host: str, port: int = 0) -> socket.socket:
    """P's control listener; port 0 takes an ephemeral port (the ticket names the real one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    srv = socket.create_server((host, port), family=family, backlog=64)
    srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return srv


def connect_tcp(host: str, port: int, timeout_s: float) -> socket.socket:
    """Connect to a P's control listener; raises OSError when nothing answers."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock
