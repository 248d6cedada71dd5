"""Another local user cannot read the unit's key or secret, nor talk to its sockets.

The unit's files and sockets live in `$XDG_RUNTIME_DIR/tandem-<uid>-<unit>/` (mode 0700): the API key
(`api.key`), the TCP unit secret (`tcp.secret`), P's control socket (`p-<slot>.sock`) and the proxy's
(`proxy.sock`). A forked child switches to uid/gid 65534 (nobody) and tries each; the base directory
is made traversable for it, so the unit directory is the only barrier. Behind that barrier P and the
proxy also check the peer's uid (SO_PEERCRED): with the directory and socket loosened on purpose, the
other user connects but is hung up on before anything is read. Needs root (to switch uid); skipped
otherwise.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tandem.serving.api_key import resolve
from tandem.transfer import HostShmPath, TransferSender, WireLayout
from tandem.transfer.auth import SECRET_NAME, unit_secret
from tandem.transfer.control import connect_unix, control_dir
from tandem.transfer.paths.proxy_sidecar import ProxyServer, proxy_socket_path, recv_msg, send_msg

NOBODY = 65534
UNIT = "sec"
LAYOUT = WireLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_name="bfloat16")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")


def as_nobody(probe: Callable[[], int]) -> int:
    """Exit status of `probe()` run in a forked child as uid/gid 65534 with no groups (255: it raised)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 255
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = probe()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def refused_open(path: Path) -> Callable[[], int]:
    def probe() -> int:
        try:
            os.open(path, os.O_RDONLY)
        except PermissionError:
            return 0
        return 1

    return probe


def connect_outcome(path: str) -> Callable[[], int]:
    """0: connect refused (EACCES); 1: connected and served; 2: connected and hung up on at once."""

    def probe() -> int:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5.0)
        try:
            s.connect(path)
        except PermissionError:
            return 0
        try:
            s.sendall(b"\x00\x00\x00\x0d" + b'{"op":"ping"}')  # a proxy request; P reads a HELLO first
            return 2 if s.recv(1) == b"" else 1
        except (ConnectionResetError, BrokenPipeError):
            return 2
        except TimeoutError:
            return 1  # kept open: it would be served
        finally:
            s.close()

    return probe


def proxy_answers(path: str) -> bool:
    """Our own uid gets a reply from the proxy (an error for an unknown op: no CUDA needed)."""
    with connect_unix(path, 5.0) as sock:
        send_msg(sock, {"op": "nothing"})
        return "unknown op" in str(recv_msg(sock).get("error"))


@pytest.fixture
def unit(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="tandem-local-users-"))
    os.chmod(base, 0o755)  # nobody may look in here; only the unit directory is private
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    d = control_dir(UNIT)
    assert as_nobody(lambda: 0 if os.listdir(base) == [d.name] else 1) == 0  # the barrier is d itself
    yield d
    os.chmod(d, 0o700)


@pytest.fixture
def sender(unit: Path) -> Iterator[TransferSender]:
    s = TransferSender(LAYOUT, UNIT, HostShmPath(), lambda _: None, lambda _: None, slot="p0")
    s.start()
    yield s
    s.close()


@pytest.fixture
def proxy(unit: Path) -> Iterator[str]:
    server = ProxyServer(UNIT)
    server.start()
    yield proxy_socket_path(UNIT)
    server.close()


def test_another_user_cannot_read_the_api_key_or_the_unit_secret(unit: Path) -> None:
    key = resolve([], {"XDG_RUNTIME_DIR": str(unit.parent)}).source
    assert key == unit.parent / f"tandem-{os.getuid()}-default" / "api.key"
    unit_secret(unit)
    for path in (key, unit / SECRET_NAME):
        assert as_nobody(refused_open(path)) == 0, path
        assert as_nobody(lambda p=path: 0 if os.access(p.parent, os.X_OK) else 1) == 1  # the directory


def test_another_user_cannot_connect_to_p_or_the_proxy(
    sender: TransferSender, proxy: str, unit: Path
) -> None:
    p_sock = str(unit / "p-p0.sock")
    assert os.path.exists(p_sock) and os.path.exists(proxy)
    assert as_nobody(connect_outcome(p_sock)) == 0
    assert as_nobody(connect_outcome(proxy)) == 0
    assert proxy_answers(proxy)  # our own uid is served


def test_behind_a_loosened_directory_the_peer_uid_check_hangs_up(
    sender: TransferSender, proxy: str, unit: Path
) -> None:
    """Defence in depth: a directory and sockets someone opened up by mistake still let no other uid
    talk to P or the proxy."""
    p_sock = str(unit / "p-p0.sock")
    os.chmod(unit, 0o711)
    for path in (p_sock, proxy):
        os.chmod(path, 0o777)
        assert as_nobody(connect_outcome(path)) == 2, path
    assert proxy_answers(proxy)


def test_the_control_directory_is_refused_once_loosened(unit: Path) -> None:
    """Every P, D and proxy checks the directory when it starts: a loosened one stops them."""
    from tandem.transfer.errors import UnsafeControlDir

    os.chmod(unit, 0o711)
    with pytest.raises(UnsafeControlDir, match="expected 700"):
        control_dir(UNIT)
