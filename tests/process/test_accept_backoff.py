"""Out of file descriptors on accept: the gateway's loop (`gateway/accept_loop.py`) backs off once
per second; asyncio's own loop (the finding: 214,563 errors in 10 s) tries and logs again for every
connection waiting. A child process with few descriptors serves a listening socket on each loop
while 40 connections wait; the number of failed accepts it logs in 3 s is the measure."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

CHILD = r"""
import asyncio, logging, resource, socket, sys, time
from tandem.gateway.accept_loop import GatewayLoop
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
lsock = socket.socket(); lsock.bind(("127.0.0.1", 0)); lsock.listen(128)
print(lsock.getsockname()[1], flush=True)
held = []
loop = GatewayLoop() if sys.argv[1] == "gateway" else asyncio.SelectorEventLoop()
def handler(loop, context):
    print("cannot accept:", context.get("message"), flush=True)
loop.set_exception_handler(handler)
async def main():
    server = await loop.create_server(asyncio.Protocol, sock=lsock, backlog=128)
    # every descriptor is in use now: accept() fails with EMFILE from here on
    while True:
        try:
            held.append(socket.socket())
        except OSError:
            break
    await asyncio.sleep(3.0)
    server.close()
loop.run_until_complete(main())
"""


@pytest.mark.parametrize("kind", ["gateway", "asyncio"])
def test_emfile_on_accept_backs_off(kind: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    clients = []
    try:
        for _ in range(40):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        out, _ = proc.communicate(timeout=60)
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
    failures = sum("cannot accept" in line for line in out.splitlines())
    print(f"{kind}: {failures} failed accepts logged in 3 s")
    if kind == "gateway":
        assert 1 <= failures <= 5, out[-2000:]  # once per second of the 3
    else:
        assert failures > 30, f"asyncio's loop no longer spins ({failures}): accept_loop.py may go"
