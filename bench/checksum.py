"""`tandem-bench-checksum`: D's KV verification latency, alone and beside a busy engine thread.

    tandem-bench-checksum --mib 288 --out docs/benchmarks            # on the device: --device cuda:0
    tandem-bench-checksum --device cuda:0 --paths torch,kernel,rows  # the fused kernel against torch
    tandem-bench-checksum --device cuda:0 --paths rows,write         # P's hash before / inside its write

D verifies every DONE on the control connection's reader thread (`transfer/verifier.py`),
while the engine thread runs decode steps in the same process. Both hold the GIL between torch calls,
and every torch call releases and re-takes it, so a hash issued as many small calls waits for the
engine at every call. This bench measures the checksum of `--mib` MiB on `--device`:

    alone   nothing else runs in the process
    busy    a thread loops like an engine: small torch ops with Python work between them

for each `--paths` entry:

    torch   `reference_kv_checksum` (the torch code; also the CPU path), once per `--groups` value
            (`_GROUP`: 8 MiB chunks hashed per torch call; shipped: 1 on a CPU, 8 on CUDA, see
            `transfer/checksum.py`)
    kernel  `kv_checksum` through the fused kernel (csrc/kv_checksum.cu), the bytes as one flat array
    rows    `kv_checksum_rows`: the same bytes viewed as a pool [--layers, 2, S, --row-bytes] read in
            place at every slot in shuffled order (page size 1, fully fragmented; the kernel's P/D use)
    hash_then_write   P's direct-mode hand-off before the fused kernel: `rows`, then `gather_write`
            of every row into a second pool of the same shape at other shuffled slots (on one GPU:
            the local write, not NVLink), synchronised
    write_hash        the same write by `gather_write_checksum`, which hashes what it stores (what
            the GPU paths' `write_rows` run now); its value must equal `rows`'
    write             the write alone (`gather_write`, synchronised), the floor for the two above

torch and kernel must give the same checksum (asserted), rows the value of its torch reference
(asserted, untimed), hash_then_write and write_hash the value of rows (asserted). All but torch need
CUDA and the built module; elsewhere they are skipped with a note. Median, p90 and max over `--reps`.
Writes `<out>/<name>.json`; each result row carries `path` and, for torch, `group` (null for the
kernel paths).
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tandem.bench import util as benchutil
from tandem.csrc import kv_cuda
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


def measure(
    fn: Callable[[], int], device: torch.device, busy: bool, reps: int
) -> tuple[list[float], int, int]:
    """Seconds per `fn()` (one checksum, blocking until its value is on the host); the checksum;
    engine steps seen."""
    stop = threading.Event()
    steps = [0]
    thread = None
    if busy:
        thread = threading.Thread(target=_engine_like, args=(stop, device, steps), daemon=True)
        thread.start()
        time.sleep(0.2)
    try:
        value = fn()  # warm-up (weights table, allocator, module load)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            assert fn() == value
            times.append(time.perf_counter() - t0)
        return times, value, steps[0]
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def _torch_with_group(data: torch.Tensor, group: int) -> Callable[[], int]:
    def run() -> int:
        saved = ck._GROUP
        ck._GROUP = group
        try:
            return ck.reference_kv_checksum(data)
        finally:
            ck._GROUP = saved

    return run


def _rows_case(data: torch.Tensor, layers: int, row_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`data` as a pool [layers, 2, S, row_bytes] (uint8) and every slot once, shuffled."""
    per_slot = layers * 2 * row_bytes
    if row_bytes % 8 or data.numel() % per_slot:
        raise SystemExit(
            f"--mib bytes are not whole slots of {layers} x 2 x {row_bytes} B (row bytes % 8 == 0)"
        )
    pool = data.view(layers, 2, data.numel() // per_slot, row_bytes)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(pool.shape[2], generator=g).to(data.device)
    return pool, slots


def _write_cases(
    pool: torch.Tensor, slots: torch.Tensor, want: int, why_not: str
) -> tuple[list[tuple[str, int | None, Callable[[], int]]], list[str]]:
    """The direct-mode write, with P's hash before it or inside it, into a second pool (shuffled)."""
    dst = torch.empty_like(pool)
    dst_slots = slots[
        torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(1)).to(slots.device)
    ]
    if not kv_cuda.gather_write_checksum_supported(pool, dst):
        return [], [f"write paths: no fused kernel for this pool ({why_not})"]
    n = slots.numel()

    def write() -> int:
        kv_cuda.gather_write(pool, slots, dst, dst_slots, check_bounds=False)
        torch.cuda.synchronize(pool.device)
        return 0

    def hash_then_write() -> int:
        value = ck.kv_checksum_rows(pool, slots)
        write()
        return value

    def write_hash() -> int:
        return ck.rows_checksum_from_lanes(
            kv_cuda.gather_write_checksum(pool, slots, dst, dst_slots, check_bounds=False), pool, n
        )

    if write_hash() != want or hash_then_write() != want:
        raise SystemExit("the fused write's checksum differs from kv_checksum_rows")
    return [
        ("hash_then_write", None, hash_then_write),
        ("write_hash", None, write_hash),
        ("write", None, write),
    ], []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=288, help="bytes hashed per call, in MiB")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--groups", default="1,8", help="comma-separated _GROUP values to compare (torch path)")
    ap.add_argument(
        "--paths", default="torch", help="comma-separated: torch, kernel, rows, write (see above)"
    )
    ap.add_argument("--layers", type=int, default=36, help="rows path: pool layers (qwen3-4b: 36)")
    ap.add_argument("--row-bytes", type=int, default=2048, help="rows path: bytes per row (qwen3-4b: 2048)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--name", default="checksum")
    args = ap.parse_args(argv)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    known = ("torch", "kernel", "rows", "write")
    unknown = sorted(set(paths) - set(known))
    if unknown:
        raise SystemExit(f"unknown --paths entries {unknown}: use {', '.join(known)}")
    device = torch.device(args.device)
    data = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8, device=device)
    why_not = "needs --device cuda" if device.type != "cuda" else kv_cuda.build_info()
    cases: list[tuple[str, int | None, Callable[[], int]]] = []
    skipped: list[str] = []
    for path in paths:
        if path == "torch":
            cases += [("torch", int(g), _torch_with_group(data, int(g))) for g in args.groups.split(",")]
        elif path == "kernel":
            if kv_cuda.checksum_tensor_supported(data):
                cases.append(("kernel", None, functools.partial(ck.kv_checksum, data)))
            else:
                skipped.append(f"kernel: no kernel for this tensor ({why_not})")
        elif path == "write":
            pool, slots = _rows_case(data, args.layers, args.row_bytes)
            if kv_cuda.checksum_rows_supported(pool):
                more, notes = _write_cases(pool, slots, ck.reference_kv_checksum_rows(pool, slots), why_not)
                cases += more
                skipped += notes
            else:
                skipped.append(f"write paths: no kernel for this pool ({why_not})")
        else:
            pool, slots = _rows_case(data, args.layers, args.row_bytes)
            if kv_cuda.checksum_rows_supported(pool):
                want = ck.reference_kv_checksum_rows(pool, slots)
                assert ck.kv_checksum_rows(pool, slots) == want, (
                    "rows kernel differs from its torch reference"
                )
                cases.append(("rows", None, functools.partial(ck.kv_checksum_rows, pool, slots)))
            else:
                skipped.append(f"rows: no kernel for this pool ({why_not})")
    for note in skipped:
        print(f"skipped {note}", flush=True)
    results: list[dict[str, Any]] = []
    values = set()
    for path, group, fn in cases:
        for busy in (False, True):
            times, value, steps = measure(fn, device, busy, args.reps)
            if path in ("torch", "kernel"):
                values.add(value)
            results.append(
                {
                    "path": path,
                    "group": group,
                    "busy": busy,
                    "engine_steps": steps,
                    **benchutil.summary(times),
                }
            )
            r = results[-1]
            label = f"group {group:2d}" if group is not None else f"{path:8s}"
            print(
                f"{label} {'busy ' if busy else 'alone'}: median {r['median_ms']:.3f} ms, "
                f"p90 {r['p90_ms']:.3f} ms, max {r['max_ms']:.3f} ms",
                flush=True,
            )
    assert len(values) <= 1, "grouping or the kernel changed the checksum"
    if args.out is not None:
        meta = {
            **benchutil.provenance(device, "tandem-bench-checksum", argv),
            "benchmark": "checksum",
            "mib": args.mib,
            "reps": args.reps,
            "paths": paths,
            "skipped": skipped,
            "layers": args.layers,
            "row_bytes": args.row_bytes,
        }
        benchutil.write_json(args.out / f"{args.name}.json", {"meta": meta, "results": results})
        print(f"wrote {args.out / args.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
