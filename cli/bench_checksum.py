"""`tandem-bench-checksum`: D's KV verification latency, alone and beside a busy engine thread.

    tandem-bench-checksum --mib 288 --out docs/benchmarks            # on the device: --device cuda:0

D verifies every DONE on the control connection's reader thread (`transfer/receiver.py: _verify`),
while the engine thread runs decode steps in the same process. Both hold the GIL between torch calls,
and every torch call releases and re-takes it, so a hash issued as many small calls waits for the
engine at every call. This bench measures `kv_checksum` over `--mib` MiB on `--device`:

    alone   nothing else runs in the process
    busy    a thread loops like an engine: small torch ops with Python work between them

for each `--groups` value (`_GROUP`: 8 MiB chunks hashed per torch call; shipped: 1 on a CPU, 8 on
CUDA, see `transfer/checksum.py`). Every setting gives the same checksum (asserted). Median, p90 and
max over `--reps`. Writes `<out>/<name>.json`.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tandem.cli import benchutil
from tandem.transfer import checksum as ck


def _engine_like(stop: threading.Event, device: torch.device, steps: list[int]) -> None:
    """A stand-in for the decode loop's CPU side: ~40 small torch calls per step, Python in between."""
    x = torch.randn(64, 64, device=device)
    rows = [list(range(8)) for _ in range(64)]
    while not stop.is_set():
        for _ in range(40):
            x = torch.tanh(x @ x * 1e-3)
            _ = [sum(r) for r in rows]  # bookkeeping in Python while holding the GIL
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps[0] += 1


def measure(data: torch.Tensor, group: int, busy: bool, reps: int) -> tuple[list[float], int, int]:
    """Seconds per `kv_checksum(data)` with `ck._GROUP = group`; the checksum; engine steps seen."""
    saved = ck._GROUP
    ck._GROUP = group
    stop = threading.Event()
    steps = [0]
    thread = None
    if busy:
        thread = threading.Thread(target=_engine_like, args=(stop, data.device, steps), daemon=True)
        thread.start()
        time.sleep(0.2)
    try:
        value = ck.kv_checksum(data)  # warm-up (weights table, allocator)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert ck.kv_checksum(data) == value
            times.append(time.perf_counter() - t0)
        return times, value, steps[0]
    finally:
        ck._GROUP = saved
        stop.set()
        if thread is not None:
            thread.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=288, help="bytes hashed per call, in MiB")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--groups", default="1,8", help="comma-separated _GROUP values to compare")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="checksum")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    data = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8, device=device)
    results: list[dict[str, Any]] = []
    values = set()
    for group in (int(g) for g in args.groups.split(",")):
        for busy in (False, True):
            times, value, steps = measure(data, group, busy, args.reps)
            values.add(value)
            results.append({"group": group, "busy": busy, "engine_steps": steps, **benchutil.summary(times)})
            r = results[-1]
            print(
                f"group {group:2d} {'busy ' if busy else 'alone'}: median {r['median_ms']:.1f} ms, "
                f"p90 {r['p90_ms']:.1f} ms, max {r['max_ms']:.1f} ms",
                flush=True,
            )
    assert len(values) == 1, "grouping changed the checksum"
    if args.out is not None:
        meta = {
            **benchutil.provenance(device, "tandem-bench-checksum", argv),
            "benchmark": "checksum",
            "mib": args.mib,
            "reps": args.reps,
        }
        benchutil.write_json(args.out / f"{args.name}.json", {"meta": meta, "results": results})
        print(f"wrote {args.out / args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
