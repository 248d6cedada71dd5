"""The watcher `serving/stub_guard.py` puts beside each stub, on real processes: it SIGKILLs its stub
once the stub's server is gone, and leaves a stub alone while its server lives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tandem.serving import process_tree
from tandem.serving.stub_guard import STATE_ENV, WATCH_SH, reloads_of

# A stand-in "server" (sh) whose child, the "stub" (python), starts the watcher on itself as
# StubGuard does, then sleeps: as a real stub, it never exits by itself.
STUB = (
    "import os, subprocess, sys, time\n"
    "subprocess.Popen(['sh', '-c', sys.argv[1], 'tandem-stub-watch', str(os.getpid()), str(os.getppid())])\n"
    "time.sleep(120)\n"
)


def _stub_of(server: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = process_tree.children(server.pid)
        if kids and process_tree.children(kids[0]):  # the stub, and its watcher started
            return kids[0]
        time.sleep(0.05)
    raise AssertionError("the stand-in stub did not start its watcher")


def _server() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sh", "-c", f'"{sys.executable}" -c "$1" "$2" & wait', "server", STUB, WATCH_SH])


def test_the_watcher_kills_a_stub_whose_server_died() -> None:
    server = _server()
    stub = _stub_of(server)
    server.send_signal(signal.SIGKILL)
    server.wait()
    killed = time.monotonic()
    while process_tree.alive(stub) and time.monotonic() - killed < 5:
        time.sleep(0.05)
    assert not process_tree.alive(stub), "the stub outlived its server by 5 s"


def test_the_watcher_leaves_a_served_stub_alone_and_ends_with_it() -> None:
    server = _server()
    try:
        stub = _stub_of(server)
        watcher = process_tree.children(stub)[0]
        time.sleep(2.5)  # a few rounds of the watcher
        assert process_tree.alive(stub)
        os.kill(stub, signal.SIGKILL)  # the stub dies first (its server lives): the watcher ends
        deadline = time.monotonic() + 5
        while process_tree.alive(watcher) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_tree.alive(watcher), "the watcher outlived its stub"
    finally:
        server.kill()
        server.wait()


def test_reload_counts_come_from_the_supervisors_state_file(tmp_path: Path) -> None:
    state = tmp_path / "unit-state.json"
    state.write_text(json.dumps({"reloads": {"decode": 2}}))
    env = {STATE_ENV: str(state)}
    assert reloads_of("decode", env) == 2 and reloads_of("prefill", env) == 0
    assert reloads_of("decode", {}) == 0  # no supervisor
    state.write_text("not json")
    assert reloads_of("decode", env) == 0
