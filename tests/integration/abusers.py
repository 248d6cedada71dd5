"""Clients that misbehave on purpose, for `test_abuse.py`.

`vanish()` starts a separate process that opens streams, waits until each has its first response,
prints READY and is then killed with SIGKILL by the caller: its TCP connections die with it, no
cancel is ever sent (what a crashed or unplugged listener does). `python -m
tests.integration.abusers URL MAX_TOKENS MODEL...` is that process.

`one_shot()` is a well-formed request as the wire helper sends it (a fresh stream id each time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np
from tritonclient.grpc import service_pb2

from tandem.cli.tts_client import next_stream_id
from tests.integration.helpers import prompt
from tests.integration.server import REPO
from tests.integration.wire import Connection, WireTensor, request


def one_shot(
    model: str, rows: int, max_tokens: int, seed: int = 0, request_id: str = ""
) -> service_pb2.ModelInferRequest:
    tensors = [
        WireTensor.of("PROMPT", prompt(rows, seed=seed)),
        WireTensor.of("MAX_TOKENS", np.array([max_tokens], np.int32)),
        WireTensor.of("TEMPERATURE", np.array([0.0], np.float32)),
    ]
    sid = next_stream_id()
    return request(model, tensors, request_id or f"r{sid}", sid, True, True)


class Vanishing:
    """A process holding one stream per entry of `models`, each on its own connection."""

    def __init__(self, url: str, models: Sequence[str], max_tokens: int, timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.abusers", url, str(max_tokens), *models],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until READY (or the process dies)
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"abuser did not get its streams going: {line!r}")

    def vanish(self) -> None:
        """SIGKILL: the kernel closes the sockets; no gRPC cancel, no half-close, nothing."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def _main(argv: Sequence[str]) -> None:
    url, max_tokens, models = argv[0], int(argv[1]), argv[2:]
    conns = [Connection(url) for _ in models]
    for i, (conn, model) in enumerate(zip(conns, models, strict=True)):
        conn.send(one_shot(model, 40, max_tokens, seed=i))
    deadline = time.monotonic() + 60
    for conn in conns:  # the first response of each stream: it is admitted and decoding
        while not conn.collect_strays(0.05) and time.monotonic() < deadline:
            pass
    print("READY", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    _main(sys.argv[1:])
