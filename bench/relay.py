"""`tandem-bench-relay`: what the stub<->worker hop costs per response, the price of running each engine
in its own worker process (docs/benchmarks/README.md, relay-cpu.json).

Two real processes over the channel the engines use (`backend/worker/channel.py`, a socket pair): a child
plays the worker and sends Replies shaped like D's chunks (TOKENS [rows, W] int64, FIRST_ROW, TIMINGS)
or tts_mono's (plus AUDIO [rows x samples_per_row] float32); this process plays the stub's relay
thread: reads each frame, decodes it and turns every output into its numpy array (what
`serving/engine_stub.py` hands `pb_utils.Tensor`; building Triton tensors and sending them cost the
same as before the split, so they are not part of the hop).

Figures per shape:
- latency: one Reply at a time (2 ms apart): worker's send() -> relay holds the numpy arrays; p50/p99;
- relay CPU per response: the stub side's own work (read, decode, arrays) when replies queue up;
- worker CPU per response: the engine thread's part (arrays -> Reply -> msgpack, queued to the writer).

    tandem-bench-relay --out docs/benchmarks --name relay-cpu
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.worker.channel import Array, Channel, Reply, Stop
from tandem.bench import util as benchutil

SHAPES = {"decode-4rows": (4, 0), "decode-32rows": (32, 0), "mono-32rows": (32, 1050)}


def reply(rows: int, samples_per_row: int, stamp_ns: int) -> Reply:
    """A chunk's Reply of this shape; its first row's first id carries the send time."""
    tokens = np.zeros((rows, 4), dtype=np.int64)
    tokens[0, 0] = stamp_ns
    audio = Array.of(np.zeros(rows * samples_per_row, dtype=np.float32)) if samples_per_row else None
    return Reply(1, False, rows=Array.of(tokens), audio=audio)


def child(fd: int, n: int) -> None:
    """The worker side: for each shape, `n` paced replies, then `n` back to back; then Stop."""
    ch = Channel(socket.socket(fileno=fd), "bench-worker")
    for rows, spr in SHAPES.values():
        for _ in range(n):
            ch.send(reply(rows, spr, time.perf_counter_ns()))
            time.sleep(0.002)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            ch.send(reply(rows, spr, time.perf_counter_ns()))
        cost = (time.perf_counter_ns() - t0) / n
        ch.send(Reply(0, True, timings=repr(cost)))  # the worker's cost per response, ns
    ch.send(Stop())
    ch.close()


def relay_one(ch: Channel) -> tuple[Any, int]:
    msg = ch.recv()
    assert isinstance(msg, Reply | Stop), msg
    if isinstance(msg, Reply):
        arrays = [a.numpy() for a in (msg.rows, msg.audio) if a is not None]  # what the stub converts
        return msg, time.perf_counter_ns() if arrays else 0
    return msg, 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-relay", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="replies per shape and phase")
    ap.add_argument("--child-fd", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--name", default="relay-cpu")
    args = ap.parse_args(argv)
    if args.child_fd >= 0:
        child(args.child_fd, args.n)
        return 0
    mine, theirs = socket.socketpair()
    cmd = [
        sys.executable,
        "-m",
        "tandem.bench.relay",
        "--n",
        str(args.n),
        "--child-fd",
        str(theirs.fileno()),
    ]
    proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
    theirs.close()
    ch = Channel(mine, "bench-stub")
    result: dict[str, Any] = {
        **benchutil.provenance(torch.device("cpu"), "tandem-bench-relay", argv),
        "shapes": {},
    }
    rows_out = []
    for name, (rows, spr) in SHAPES.items():
        lat = []
        for _ in range(args.n):
            msg, now = relay_one(ch)
            assert isinstance(msg, Reply) and msg.rows is not None
            lat.append((now - int(msg.rows.numpy()[0, 0])) / 1e3)
        t0 = time.perf_counter_ns()
        for _ in range(args.n):
            relay_one(ch)
        relay_us = (time.perf_counter_ns() - t0) / args.n / 1e3
        msg, _ = relay_one(ch)
        assert isinstance(msg, Reply)
        worker_us = float(msg.timings) / 1e3
        nbytes = rows * 4 * 8 + rows * spr * 4
        fig = {
            "payload_bytes": nbytes,
            "latency_us_p50": round(benchutil.quantile(lat, 0.5), 1),
            "latency_us_p99": round(benchutil.quantile(lat, 0.99), 1),
            "relay_cpu_us_per_response": round(relay_us, 1),
            "worker_cpu_us_per_response": round(worker_us, 1),
        }
        result["shapes"][name] = fig
        rows_out.append([name, *fig.values()])
    relay_one(ch)  # Stop
    proc.wait(30)
    headers = ["shape", "bytes", "latency p50 us", "latency p99 us", "relay us/resp", "worker us/resp"]
    print(benchutil.format_table(headers, rows_out))
    if args.out:
        benchutil.write_json(args.out / f"{args.name}.json", result)
        print(f"wrote {args.out / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
