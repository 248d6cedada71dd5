"""Clients that misbehave on purpose, for `test_abuse.py`.

`vanish()` starts a separate process that opens streams, waits until each has its first response,
prints READY and is then killed with SIGKILL by the caller: its TCP connections die with it, no
cancel is ever sent (what a crashed or unplugged listener does). `python -m
tests.support.abusers URL MAX_TOKENS MODEL...` is that process.

`flood()` sends many streams at once, one connection each, and returns their first answers;
`read_stream()` is a well-behaved client beside the abuse. `one_shot()` is a well-formed request as
the wire helper sends it (a fresh stream id each time), `opening()` one that starts its stream and
never ends it. `sequence_batching()` reads a model's sequence batcher from its config.pbtxt,
`set_sequence_bounds()` changes it in a rendered repository.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2

from tandem.gateway.client import StreamResult, TTSClient, next_stream_id
from tests.support.helpers import prompt
from tests.support.server import REPO
from tests.support.wire import Connection, Response, WireTensor, request


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


def opening(model: str, max_tokens: int, seed: int = 0) -> service_pb2.ModelInferRequest:
    """`sequence_start` without `sequence_end`: the stream stays open in Triton's sequence batcher
    after its request is answered (or refused: `max_tokens` 0 is `[INVALID_ARG]`)."""
    tensors = [
        WireTensor.of("PROMPT", prompt(10, seed=seed)),
        WireTensor.of("MAX_TOKENS", np.array([max_tokens], np.int32)),
    ]
    sid = next_stream_id()
    return request(model, tensors, f"open{sid}", sid, True, False)


def sequence_batching(config: Path) -> model_config_pb2.ModelSequenceBatching:
    """The `sequence_batching` section of a model's config.pbtxt, as Triton parses it."""
    return text_format.Parse(config.read_text(), model_config_pb2.ModelConfig()).sequence_batching


def set_sequence_bounds(repo: Path, models: Sequence[str], slots: int, idle_s: float) -> None:
    """Give `models` of the rendered repository `repo` `slots` sequence slots per instance and an idle
    timeout of `idle_s`; raises ValueError where a config lacks either setting to change."""
    for model in models:
        path = repo / model / "config.pbtxt"
        text, n_slots = re.subn(
            r"max_candidate_sequences: \d+", f"max_candidate_sequences: {slots}", path.read_text()
        )
        idle = f"max_sequence_idle_microseconds: {round(idle_s * 1e6)}"
        text, n_idle = re.subn(r"max_sequence_idle_microseconds: \d+", idle, text)
        if (n_slots, n_idle) != (1, 1):
            raise ValueError(f"{path}: expected one max_candidate_sequences and one idle timeout")
        path.write_text(text)


def flood(url: str, model: str, n: int, rows: int) -> list[tuple[float, Response | str]]:
    """`n` streams of `rows` at once, one connection each; every connection is closed once each
    request has its first answer. Returns (seconds from send to the first answer, that answer) per
    request; raises AssertionError when one got none within 60 s."""
    conns = [Connection(url) for _ in range(n)]
    sent = []
    try:
        for i, conn in enumerate(conns):
            sent.append(time.monotonic())
            conn.send(one_shot(model, 40, rows, seed=i))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(c.log for c in conns):
            time.sleep(0.05)
        assert all(c.log for c in conns), "a request got no answer within 60 s"
        return [(c.log[0][0] - t, c.log[0][1]) for c, t in zip(conns, sent, strict=True)]
    finally:
        for c in conns:
            c.close()


def read_stream(url: str, model: str, rows: int) -> StreamResult:
    """A well-behaved client beside the abuse: one greedy stream of `rows`, read as it comes."""
    with TTSClient(url, model) as c:
        return c.run(prompt(30, seed=5), MAX_TOKENS=rows, TEMPERATURE=0.0)


class Vanishing:
    """A process holding one stream per entry of `models`, each on its own connection."""

    def __init__(self, url: str, models: Sequence[str], max_tokens: int, timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.abusers", url, str(max_tokens), *models],
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
