"""The proxy keeps P's instance lock held while it may still copy for P (CPU: no copy runs here).

A proxy copy requested by P finishes even if P dies mid-copy, so P's death alone must not look like
proof to D. P hands its lock fd to the proxy on every request connection; the proxy closes it only
after that connection's thread is done. These tests drive a real `ProxyServer` and real processes;
the copy itself needs CUDA and is covered by tests/process/test_gpu_paths.py on the device.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.transfer.control import InstanceLock, control_dir, instance_gone
from tandem.transfer.errors import TransferError
from tandem.transfer.paths.proxy import ProxyPath
from tandem.transfer.paths.proxy_sidecar import ProxyClient, ProxyServer, proxy_socket_path


@pytest.fixture
def unit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    name = f"pl{os.getpid()}"
    server = ProxyServer(name)
    server.start()
    yield name
    server.close()


def _until(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_lock_outlives_p_until_its_proxy_connections_close(unit: str, tmp_path: Path) -> None:
    lock = InstanceLock(tmp_path / "p-slot.lock")
    assert lock.try_acquire()
    path = ProxyPath(unit=unit)
    path.share_instance_lock(lock.fd)
    path._client()  # what the first copy on a copy worker does
    lock.release()  # P's own descriptor is gone (as at P's death)...
    time.sleep(0.2)
    assert not instance_gone(str(lock.path)), "the proxy must still hold P's lock"
    path.share_instance_lock(None)  # ...and its proxy connections close: now it is proof
    assert _until(lambda: instance_gone(str(lock.path)))


def test_killed_p_frees_its_lock_only_through_the_proxy(unit: str, tmp_path: Path) -> None:
    """SIGKILL a real P-like process: its lock is free once the proxy saw the connection close."""
    lock_path = tmp_path / "p-slot.lock"
    child = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from tandem.transfer.control import InstanceLock
        from tandem.transfer.paths.proxy import ProxyPath
        lock = InstanceLock(Path({str(lock_path)!r}))
        assert lock.try_acquire()
        path = ProxyPath(unit={unit!r})
        path.share_instance_lock(lock.fd)
        path._client()
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert not instance_gone(str(lock_path))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        gone = _until(lambda: instance_gone(str(lock_path)))
        assert gone, "lock still held after P and its connection died"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_hold_requests_get_clear_errors_and_keep_the_connection(unit: str) -> None:
    client = ProxyClient(proxy_socket_path(unit))
    try:
        with pytest.raises(TransferError, match="exactly one file descriptor"):
            client.request(op="hold_lock")
        with tempfile.TemporaryFile() as f:
            with pytest.raises(TransferError, match="not a held instance lock"):
                client.request(op="hold_lock", fds=(f.fileno(),))
            with pytest.raises(TransferError, match="'register' takes no file descriptors"):
                client.request(op="register", fds=(f.fileno(),), role="arena")
        a, b = socket.socketpair()
        with a, b, pytest.raises(TransferError, match="not an instance lock file"):
            client.request(op="hold_lock", fds=(a.fileno(),))  # not reopenable: refused, fd closed
        with pytest.raises(TransferError, match="unknown op 'nope'"):
            client.request(op="nope")
    finally:
        client.close()


def test_engines_proxy_path_is_their_units_sidecar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy path an engine builds serves `tandem.transfer.unit` (what `tandem-proxy --unit`
    serves), not "default", and carries the engine's KV layout (a GPU fault-matrix run found engines
    looking for the sidecar of the unit "default")."""
    from tandem.backend.engines.parts import path_options
    from tandem.backend.settings import EngineSettings, TransferSettings
    from tandem.transfer import WireLayout, path_factories

    monkeypatch.setenv("TANDEM_UNIT", "not-this-one")  # no path reads the environment
    layout = WireLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype_name="float32")
    opts = path_options(EngineSettings(transfer=TransferSettings(unit="u9")), layout)
    path = path_factories(opts)["proxy"]()
    assert isinstance(path, ProxyPath)
    assert path.unit == "u9" and path.layout == layout
    assert path.socket_path == str(control_dir("u9") / "proxy.sock")
