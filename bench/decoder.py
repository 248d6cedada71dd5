"""`tandem-bench-decoder`: the reference decoder alone (no server, no transfer): prefill time and decode
tokens/s per stream against the preset's rate floor (its codec's real time over `--rtf`: 42 tok/s for the
reference codec, 164 for Orpheus).

    tandem-bench-decoder --preset tiny --device cpu --out docs/benchmarks
    tandem-bench-decoder --preset qwen3-4b-shape --device cuda --dtype bfloat16 \
        --batches 1,8,32,64 --context 1024,2048 --out results/

What one decode step is here: `Decoder.decode` for B streams, each already holding `context` tokens of
KV on pages handed out in a shuffled order (as a long-running pool fragments), followed by `sample` with
temperature/top-p (which sorts the vocabulary and returns the tokens to the host, as the engine does).
The sampled tokens feed the next step. Step time is the median over `--steps` steps after `--warmup`;
tokens/s per stream = 1/step time (every stream gets one row per step), aggregate = B/step time.
On CUDA each interval is timed with CUDA events around a host-synchronous step (sampling copies the
tokens to the host), so launch overhead is included. Prefill is `Decoder.prefill` of a whole prompt at
position 0 (no prefix cache), timed the same way.

`--distinct-lengths N` adds, after those, a first-call probe of prefill: N prompt lengths no call in
the process used before, each run once at position 0, then N more (also new) after a page-aligned cached
prefix (start > 0: the masked attention path, as a prefix-cache hit runs it). Each call is timed as
CUDA-synchronised wall time, so per-shape setup on the host (e.g. an SDPA backend building a plan for a
new sequence length) counts. The lengths are spread over `--distinct-range` and run in a shuffled
order; the JSON gets them under `prefill_first_call` (samples, p50/p95/max), the SDPA backends torch
had enabled under `meta.sdpa_enabled` and those `Decoder.prefill` restricts itself to under
`meta.sdpa_prefill_backends`; compare with the steady-state prefill table.

Writes <out>/<name>.json (provenance + figures) and <out>/<name>.png; `--replot FILE.json` redraws the
PNG from an existing result file.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.backend.generation.sampling import SamplingParams, sample
from tandem.backend.kv.pool import KVPool
from tandem.backend.model import prefill_attention
from tandem.backend.model.cuda_graphs import GraphedDecode
from tandem.backend.model.decoder import Decoder
from tandem.bench import roofline as decoder_roofline
from tandem.bench import util as benchutil
from tandem.csrc import linear

_T = TypeVar("_T")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


class _Timer:
    """Times host-synchronous callables: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], _T]) -> tuple[float, _T]:
        """(seconds, fn's result)."""
        if not self.cuda:
            t0 = time.perf_counter()
            value = fn()
            return time.perf_counter() - t0, value
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        value = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, value


DecodeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], torch.Tensor]


def _fp8_weights(dec: Decoder) -> list[Any]:
    """Every E4M3 projection of an FP8 decoder (none otherwise)."""
    return [w for q in dec.fp8_layers or [] for w in (q.qkv, q.o, q.gate_up, q.down)]


def _step(
    decode: DecodeFn,
    rows: torch.Tensor,
    slot_tables: list[torch.Tensor],
    positions: torch.Tensor,
    params: list[SamplingParams],
) -> torch.Tensor:
    """One engine decode step: logits for every stream, then the sampled rows (on the host)."""
    logits = decode(rows, slot_tables, positions)
    return sample(logits, params, positions.tolist())


def bench_prefill(
    dec: Decoder, pool: KVPool, prompts: list[int], warmup: int, reps: int, timer: _Timer, peak_tflops: float
) -> list[dict[str, Any]]:
    cfg = dec.cfg
    out: list[dict[str, Any]] = []
    for n in prompts:
        pages = pool.allocate(pool.pages_for(n))
        slots = pool.slots(pages, n)
        rows = torch.randint(0, cfg.vocab_size, (n, cfg.row_width))
        run = partial(dec.prefill, rows, pool, slots, 0)
        times = [timer(run)[0] for _ in range(warmup + reps)][warmup:]
        pool.free(pages)
        s = benchutil.summary(times)
        rec = {"prompt_rows": n, **s, "rows_per_s": n / (s["median_ms"] / 1e3)}
        if pool.device.type == "cuda":
            rec["tensor_cores"] = decoder_roofline.prefill_roofline(dec, n, s["median_ms"], peak_tflops)
        out.append(rec)
    return out


def distinct_lengths(n: int, lo: int, hi: int, used: set[int]) -> tuple[list[int], list[int]]:
    """2n lengths in [lo, hi], none in `used` and no two equal, spread evenly over the range; returned
    interleaved as (n for position 0, n totals for prefixed calls) so both span the range."""
    candidates = [x for x in range(lo, hi + 1) if x not in used]
    if n < 1 or len(candidates) < 2 * n:
        raise ValueError(f"[{lo}, {hi}] holds {len(candidates)} unused lengths, {2 * n} needed")
    if n == 1 and len(candidates) == 2:
        picks = candidates
    else:
        picks = [candidates[round(i * (len(candidates) - 1) / (2 * n - 1))] for i in range(2 * n)]
    return picks[0::2], picks[1::2]


def _wall(fn: Callable[[], _T], device: torch.device) -> float:
    """Seconds of wall time for `fn`, the device synchronised before and after (host-side setup counts)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _quantiles_ms(values_s: list[float]) -> dict[str, float | int]:
    ms = [v * 1e3 for v in values_s]
    return {
        "p50_ms": benchutil.quantile(ms, 0.5),
        "p95_ms": benchutil.quantile(ms, 0.95),
        "max_ms": max(ms),
        "n": len(ms),
    }


def bench_prefill_first_calls(
    dec: Decoder, pool: KVPool, n: int, lo: int, hi: int, used: set[int], seed: int
) -> dict[str, Any]:
    """Prefill once per never-used length: n at position 0, n after a cached prefix (masked path).

    The prefix is page-aligned (about half the total, at least one page, never the whole prompt), as a
    prefix-cache hit is; its slots hold the pool's random KV. Calls run in a shuffled order (a
    monotonic order would also grow the allocator's blocks call by call)."""
    cfg = dec.cfg
    zero, prefixed = distinct_lengths(n, lo, hi, used)
    calls: list[tuple[str, int, int]] = [("position0", t, 0) for t in zero]
    for total in prefixed:
        start = max(pool.page_size, total // 2 // pool.page_size * pool.page_size)
        if start >= total:
            start = total // 2
        calls.append(("prefixed", total - start, start))
    random.Random(seed).shuffle(calls)
    samples: list[dict[str, Any]] = []
    for i, (path, rows_n, start) in enumerate(calls):
        total = start + rows_n
        pages = pool.allocate(pool.pages_for(total))
        slots = pool.slots(pages, total)
        rows = torch.randint(0, cfg.vocab_size, (rows_n, cfg.row_width))
        dt = _wall(partial(dec.prefill, rows, pool, slots, start), pool.device)
        pool.free(pages)
        samples.append(
            {"call": i, "path": path, "rows": rows_n, "start": start, "total": total, "ms": dt * 1e3}
        )
    result: dict[str, Any] = {"n": n, "range": [lo, hi], "order": "shuffled", "timer": "synchronised wall"}
    for path in ("position0", "prefixed"):
        result[path] = _quantiles_ms([x["ms"] / 1e3 for x in samples if x["path"] == path])
    result["samples"] = samples
    return result


def sdpa_enabled() -> dict[str, bool]:
    """Which scaled-dot-product-attention backends torch has enabled (only the flags this torch has).

    These are the process-wide flags; a `sdpa_kernel` context inside the decoder narrows them while it
    runs (see `sdpa_prefill_backends` in the result's meta)."""
    flags = {}
    for name in ("flash", "mem_efficient", "math", "cudnn"):
        fn = getattr(torch.backends.cuda, f"{name}_sdp_enabled", None)
        if callable(fn):
            flags[name] = bool(fn())
    return flags


def sdpa_prefill_backends() -> list[str]:
    """The SDPA backends `Decoder.prefill` restricts itself to, when the decoder declares them."""
    return [getattr(b, "name", str(b)) for b in prefill_attention.PREFILL_BACKENDS]


def bench_decode(
    dec: Decoder,
    pool: KVPool,
    decode: DecodeFn,
    batch: int,
    context: int,
    warmup: int,
    steps: int,
    params: SamplingParams,
    timer: _Timer,
    floor: float,
) -> dict[str, Any]:
    cfg = dec.cfg
    total = context + warmup + steps
    owned = [pool.allocate(pool.pages_for(total)) for _ in range(batch)]
    tables = [pool.slots(pages, total) for pages in owned]
    per_stream = [
        SamplingParams(params.temperature, params.top_p, params.top_k, seed=i) for i in range(batch)
    ]
    rows = torch.randint(0, cfg.vocab_size, (batch, cfg.row_width))
    times: list[float] = []
    for step in range(warmup + steps):
        pos = context + step  # tokens already in the pool = the new row's position
        slot_tables = [t[: pos + 1] for t in tables]
        positions = torch.full((batch,), pos, dtype=torch.long)
        dt, rows = timer(partial(_step, decode, rows, slot_tables, positions, per_stream))
        times.append(dt)
    for pages in owned:
        pool.free(pages)
    s = benchutil.summary(times[warmup:])
    step_s = s["median_ms"] / 1e3
    return {
        "batch": batch,
        "context": context,
        **{f"step_{k}": v for k, v in s.items()},
        "tok_s_per_stream": 1.0 / step_s,
        "tok_s_aggregate": batch / step_s,
        "meets_floor": 1.0 / step_s >= floor,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    if not result["decode"]:
        decoder_roofline.plot(result, path)
        return
    plt = benchutil.pyplot()
    if plt is None:
        return
    meta, decode = result["meta"], result["decode"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for ctx in sorted({d["context"] for d in decode}):
        pts = [d for d in decode if d["context"] == ctx]
        xs = [d["batch"] for d in pts]
        ax1.plot(xs, [d["tok_s_per_stream"] for d in pts], "o-", label=f"context {ctx}")
        ax2.plot(xs, [d["tok_s_aggregate"] for d in pts], "o-", label=f"context {ctx}")
    floor = meta["floor_tok_s"]
    ax1.axhline(floor, color="red", linestyle="--", label=f"{floor:.0f} tok/s floor")
    for ax, title in ((ax1, "tokens/s per stream"), (ax2, "aggregate tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(
            sorted({d["batch"] for d in decode}),
            labels=[str(b) for b in sorted({d["batch"] for d in decode})],
        )
        ax.set_xlabel("decode batch (streams)")
        ax.set_ylabel(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylim(bottom=0)
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"decoder {meta['preset']} {meta['dtype']} on {meta['device']} "
        f"(commit {meta['commit'][:10]}, torch {meta['torch']})",
    )


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(f"\ndecoder {meta['preset']} {meta['dtype']} on {meta['device']}, commit {meta['commit']}")
    if result["prefill"]:
        print("\nprefill (position 0, median of repeats)\n")
        print(
            benchutil.format_table(
                ["prompt rows", "median ms", "min ms", "p90 ms", "rows/s", "TFLOP/s", "of bf16 peak"],
                [
                    [
                        p["prompt_rows"],
                        p["median_ms"],
                        p["min_ms"],
                        p["p90_ms"],
                        p["rows_per_s"],
                        p["tensor_cores"]["tflop_s"] if "tensor_cores" in p else "-",
                        p["tensor_cores"]["tc_fraction"] if "tensor_cores" in p else "-",
                    ]
                    for p in result["prefill"]
                ],
            )
        )
    decoder_roofline.print_tables(result)
    if not result["decode"]:
        return
    print("\ndecode (one step = decode + sample, median over steps)\n")
    print(
        benchutil.format_table(
            [
                "batch",
                "context",
                "step ms",
                "p90 ms",
                "tok/s/stream",
                "tok/s aggregate",
                f">= {meta['floor_tok_s']:.0f}",
            ],
            [
                [
                    d["batch"],
                    d["context"],
                    d["step_median_ms"],
                    d["step_p90_ms"],
                    d["tok_s_per_stream"],
                    d["tok_s_aggregate"],
                    "yes" if d["meets_floor"] else "no",
                ]
                for d in result["decode"]
            ],
        )
    )
    first = result.get("prefill_first_call")
    if first:
        lo, hi = first["range"]
        print()
        for path, what in (("position0", "at position 0"), ("prefixed", "after a cached prefix")):
            q = first[path]
            print(
                f"prefill first call {what}: {q['n']} new lengths in [{lo}, {hi}]: p50 {q['p50_ms']:.2f} ms, "
                f"p95 {q['p95_ms']:.2f} ms, max {q['max_ms']:.2f} ms"
            )
        print(
            f"SDPA backends enabled: {meta.get('sdpa_enabled', 'not recorded')}; "
            f"prefill restricted to: {meta.get('sdpa_prefill_backends') or 'no restriction recorded'}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-decoder", description=__doc__.split("\n")[0])
    benchutil.add_model_arguments(ap, fp8=True)
    ap.add_argument(
        "--prompts", type=_ints, default=[256, 1024, 2048], help="prefill prompt rows, comma list"
    )
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32, 64], help="decode batch sizes, comma list")
    ap.add_argument("--context", type=_ints, default=[1024], help="tokens of KV per stream, comma list")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per configuration")
    ap.add_argument("--warmup", type=int, default=5, help="untimed decode steps first")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--prefill-warmup", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--distinct-lengths",
        type=int,
        default=0,
        metavar="N",
        help="then time prefill's first call at N new lengths from position 0 and N after a cached "
        "prefix (0: off)",
    )
    ap.add_argument(
        "--distinct-range",
        type=_ints,
        default=[1000, 2047],
        metavar="LO,HI",
        help="prompt lengths (rows, total with the prefix) the first-call probe draws from",
    )
    ap.add_argument("--graphs", action="store_true", help="replay CUDA graphs of the decode step (GPU)")
    ap.add_argument(
        "--forward-only",
        action="store_true",
        help="time the decode forward without sampling, with its roofline fraction (GPU; see "
        "bench/roofline.py for the bytes model)",
    )
    ap.add_argument("--hbm-tb-s", type=float, default=decoder_roofline.H200_HBM_TB_S)
    ap.add_argument("--tc-peak-tflops", type=float, default=decoder_roofline.H200_BF16_DENSE_TFLOPS)
    ap.add_argument(
        "--prefill-breakdown",
        type=_ints,
        default=[],
        metavar="T,...",
        help="kernel-family breakdown of one prefill of T rows from position 0 (GPU)",
    )
    ap.add_argument(
        "--breakdown",
        type=lambda t: [tuple(int(v) for v in c.split("x")) for c in t.split(",") if c],
        default=[],
        metavar="BxC,...",
        help="kernel-family breakdown of one eager forward step at these batch x context (GPU)",
    )
    ap.add_argument(
        "--reference-kernels",
        action="store_true",
        help="run the unfused step: the torch modules one by one (no fused GEMMs or Triton kernels), with "
        "the serving decode-attention kernel (the older kernel earlier 'before' runs used is deleted)",
    )
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for <name>.json and <name>.png")
    ap.add_argument("--name", help="file stem (default: decoder-<preset>-<device type>)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing result JSON")
    ap.add_argument(
        "--plot-prefill",
        nargs="+",
        metavar="PNG LABEL=JSON",
        help="only draw the prefill of result JSONs side by side into PNG (e.g. before=a.json after=b.json)",
    )
    args = ap.parse_args(argv)
    if args.plot_prefill:
        png, *specs = args.plot_prefill
        if not specs or any("=" not in s for s in specs):
            ap.error("--plot-prefill needs PNG and then LABEL=JSON entries")
        labelled = [(lbl, benchutil.read_json(Path(f))) for lbl, f in (s.split("=", 1) for s in specs)]
        decoder_roofline.plot_prefill(labelled, png)
        return 0
    if args.distinct_lengths < 0:
        ap.error("--distinct-lengths must be >= 0")
    if args.distinct_lengths:
        if len(args.distinct_range) != 2 or not 2 <= args.distinct_range[0] <= args.distinct_range[1]:
            ap.error("--distinct-range must be LO,HI with 2 <= LO <= HI")
        try:
            lo, hi = args.distinct_range
            distinct_lengths(args.distinct_lengths, lo, hi, set(args.prompts))
        except ValueError as exc:
            ap.error(f"--distinct-lengths: {exc}")

    if args.replot is not None:
        result: dict[str, Any] = benchutil.read_json(args.replot)
        plot(result, benchutil.png_beside(args.replot))
        print_tables(result)
        return 0

    device, cfg = benchutil.model_from_args(args)
    if (args.forward_only or args.breakdown) and device.type != "cuda":
        ap.error("--forward-only and --breakdown time CUDA kernels: they need --device cuda")
    timer = _Timer(device)
    t0 = time.perf_counter()
    dec = benchutil.build_model(args, cfg, device)
    cfg = dec.cfg  # an E4M3 KV changes the layout
    if args.reference_kernels:
        dec.fused = False
    longest = max(args.context) + args.warmup + args.steps
    # one spare page: the CUDA-graph runner reserves a scratch page for padding rows
    pages = max(args.batches) * -(-longest // args.page_size) + 1
    pool_tokens = max(pages * args.page_size, max(args.prompts, default=0))
    if args.distinct_lengths:
        pool_tokens = max(pool_tokens, args.distinct_range[1])
    pool = benchutil.shuffled_pool(dec, pool_tokens, args.page_size, device, args.seed)
    setup_s = time.perf_counter() - t0
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)
    floor = benchutil.floor_tok_s(args.preset, args.rtf)

    prefill = bench_prefill(
        dec, pool, args.prompts, args.prefill_warmup, args.prefill_reps, timer, args.tc_peak_tflops
    )
    decode_fn: DecodeFn
    graphed = None
    if args.graphs and device.type == "cuda":
        graphed = GraphedDecode(dec, pool, max(args.batches))
        decode_fn = graphed.decode
    else:

        def decode_fn(r: torch.Tensor, t: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
            return dec.decode(r, pool, t, p)

    decode, forward = [], []
    for ctx in args.context:
        for b in args.batches:
            if args.forward_only:
                fw = decoder_roofline.bench_forward(
                    dec, pool, decode_fn, graphed, b, ctx, args.warmup, args.steps, args.hbm_tb_s
                )
                forward.append(fw)
                rf = fw["roofline"]
                print(
                    f"  batch {b:3d} context {ctx}: forward {fw['step_ms']:.2f} ms, roofline "
                    f"{rf['roofline_ms']:.2f} ms ({rf['fraction']:.2f} of it)",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            decode.append(
                bench_decode(dec, pool, decode_fn, b, ctx, args.warmup, args.steps, params, timer, floor)
            )
            d = decode[-1]
            print(
                f"  batch {b:3d} context {ctx}: step {d['step_median_ms']:.2f} ms, "
                f"{d['tok_s_per_stream']:.1f} tok/s/stream",
                file=sys.stderr,
                flush=True,
            )

    breakdown = []
    for b, ctx in args.breakdown:
        if device.type != "cuda":
            break
        total = ctx + 1
        owned = [pool.allocate(pool.pages_for(total)) for _ in range(b)]
        tables = [pool.slots(pages, total) for pages in owned]
        rows = torch.randint(0, cfg.vocab_size, (b, cfg.row_width), device=device)
        positions = torch.full((b,), ctx, dtype=torch.long)
        fams = decoder_roofline.kernel_breakdown(
            partial(dec.decode, rows, pool, tables, positions), device, cfg.num_layers
        )
        breakdown.append({"batch": b, "context": ctx, **fams})
        for pages in owned:
            pool.free(pages)

    for n in args.prefill_breakdown:
        if device.type != "cuda":
            break
        pages = pool.allocate(pool.pages_for(n))
        rows = torch.randint(0, cfg.vocab_size, (n, cfg.row_width))
        fams = decoder_roofline.kernel_breakdown(
            partial(dec.prefill, rows, pool, pool.slots(pages, n), 0), device, cfg.num_layers
        )
        breakdown.append({"prefill_rows": n, **fams})
        pool.free(pages)

    first_call = None
    if args.distinct_lengths:
        lo, hi = args.distinct_range
        first_call = bench_prefill_first_calls(
            dec, pool, args.distinct_lengths, lo, hi, set(args.prompts), args.seed
        )

    meta = {
        **benchutil.provenance(device, "tandem-bench-decoder", argv),
        "benchmark": "decoder",
        "cuda_graphs": bool(args.graphs and device.type == "cuda"),
        "kernels": "reference (torch modules one by one, paged decode attention)"
        if args.reference_kernels
        else (
            f"fused={dec.fused}, paged decode attention, "
            f"gemv rows <= {linear.GEMV_MAX_ROWS}, prefill attention flash"
        ),
        "hbm_tb_s": args.hbm_tb_s,
        "tc_peak_tflops": args.tc_peak_tflops,
        "roofline_model": decoder_roofline.__doc__.split("\n\n")[1] if decoder_roofline.__doc__ else "",
        "preset": cfg.name,
        "dtype": "fp8" if dec.fp8_layers is not None else cfg.dtype,
        "compute_dtype": cfg.dtype,
        "kv_dtype": str(cfg.kv_torch_dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in dec.parameters()) + sum(q.data.numel() for q in _fp8_weights(dec)),
        "kv_bytes_per_token": cfg.kv_bytes_per_token,
        "page_size": args.page_size,
        "pool_tokens": pool_tokens,
        "page_order": "shuffled",
        "sampling": {"temperature": args.temperature, "top_p": args.top_p},
        "steps": args.steps,
        "warmup": args.warmup,
        "prefill_reps": args.prefill_reps,
        "timer": "cuda events" if timer.cuda else "perf_counter",
        "setup_s": setup_s,
        "floor_tok_s": floor,
        "sdpa_enabled": sdpa_enabled(),
        "sdpa_prefill_backends": sdpa_prefill_backends(),
    }
    if device.type == "cuda":
        meta["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result = {"meta": meta, "prefill": prefill, "decode": decode}
    if forward:
        result["forward"] = forward
    if breakdown:
        result["breakdown"] = breakdown
    if first_call is not None:
        result["prefill_first_call"] = first_call
    name = args.name or f"decoder-{cfg.name}-{device.type}"
    benchutil.save_result(args.out, name, result, plot, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
