"""`tandem-bench-decoder`: the reference decoder alone (no server, no transfer): prefill time and decode
tokens/s per stream against the 42 tok/s real-time floor.

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

Writes <out>/<name>.json (provenance + figures) and <out>/<name>.png; `--replot FILE.json` redraws the
PNG from an existing result file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from tandem.backend.config import ModelConfig, preset
from tandem.backend.cuda_graphs import GraphedDecode
from tandem.backend.decoder import Decoder
from tandem.backend.kv_pool import KVLayout, KVPool
from tandem.backend.sampling import SamplingParams, sample
from tandem.cli import benchutil

_T = TypeVar("_T")
FLOOR_TOK_S = 42.0  # design.md §5: every stream must sustain >= 42 rows/s
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


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


def _shuffled_pool(
    cfg: ModelConfig, n_tokens: int, page_size: int, device: torch.device, seed: int
) -> KVPool:
    """A pool for `n_tokens` whose free list hands pages out in random order, filled with random KV."""
    pages = -(-n_tokens // page_size)
    pool = KVPool(KVLayout.from_model(cfg), pages, page_size, device)
    every = pool.allocate(pages)
    random.Random(seed).shuffle(every)
    pool.free(every)  # allocate() now returns pages in this shuffled order
    gen = torch.Generator(device=device).manual_seed(seed)
    for layer in range(pool.kv.shape[0]):  # layer by layer: bounded temporaries
        pool.kv[layer].normal_(0.0, 1.0, generator=gen)
    return pool


DecodeFn = Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], torch.Tensor]


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
    dec: Decoder, pool: KVPool, prompts: list[int], warmup: int, reps: int, timer: _Timer
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
        out.append({"prompt_rows": n, **s, "rows_per_s": n / (s["median_ms"] / 1e3)})
    return out


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
        "meets_floor": 1.0 / step_s >= FLOOR_TOK_S,
    }


def plot(result: dict[str, Any], path: Path) -> None:
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
    ax1.axhline(FLOOR_TOK_S, color="red", linestyle="--", label=f"{FLOOR_TOK_S:.0f} tok/s floor")
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
    fig.suptitle(
        f"decoder {meta['preset']} {meta['dtype']} on {meta['device']} "
        f"(commit {meta['commit'][:10]}, torch {meta['torch']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(f"\ndecoder {meta['preset']} {meta['dtype']} on {meta['device']}, commit {meta['commit']}")
    print("\nprefill (position 0, median of repeats)\n")
    print(
        benchutil.format_table(
            ["prompt rows", "median ms", "min ms", "p90 ms", "rows/s"],
            [
                [p["prompt_rows"], p["median_ms"], p["min_ms"], p["p90_ms"], p["rows_per_s"]]
                for p in result["prefill"]
            ],
        )
    )
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
                f">= {FLOOR_TOK_S:.0f}",
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-decoder", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="model preset (tiny, qwen3-4b-shape)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the preset's)")
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
    ap.add_argument("--graphs", action="store_true", help="replay CUDA graphs of the decode step (GPU)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for <name>.json and <name>.png")
    ap.add_argument("--name", help="file stem (default: decoder-<preset>-<device type>)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing result JSON")
    args = ap.parse_args(argv)

    if args.replot is not None:
        result = json.loads(args.replot.read_text())
        plot(result, args.replot.with_suffix(".png"))
        print_tables(result)
        return 0

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = preset(args.preset)
    if args.dtype:
        cfg = cfg.with_dtype(_DTYPE_ALIASES.get(args.dtype, args.dtype))
    torch.manual_seed(args.seed)
    timer = _Timer(device)
    t0 = time.perf_counter()
    dec = Decoder.random(cfg, device, seed=args.seed)
    longest = max(args.context) + args.warmup + args.steps
    # one spare page: the CUDA-graph runner reserves a scratch page for padding rows
    pages = max(args.batches) * -(-longest // args.page_size) + 1
    pool_tokens = max(pages * args.page_size, max(args.prompts))
    pool = _shuffled_pool(cfg, pool_tokens, args.page_size, device, args.seed)
    setup_s = time.perf_counter() - t0
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p)

    prefill = bench_prefill(dec, pool, args.prompts, args.prefill_warmup, args.prefill_reps, timer)
    decode_fn: DecodeFn
    if args.graphs and device.type == "cuda":
        decode_fn = GraphedDecode(dec, pool, max(args.batches)).decode
    else:

        def decode_fn(r: torch.Tensor, t: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
            return dec.decode(r, pool, t, p)

    decode = []
    for ctx in args.context:
        for b in args.batches:
            decode.append(bench_decode(dec, pool, decode_fn, b, ctx, args.warmup, args.steps, params, timer))
            d = decode[-1]
            print(
                f"  batch {b:3d} context {ctx}: step {d['step_median_ms']:.2f} ms, "
                f"{d['tok_s_per_stream']:.1f} tok/s/stream",
                file=sys.stderr,
                flush=True,
            )

    meta = {
        **benchutil.provenance(device, "tandem-bench-decoder", argv),
        "benchmark": "decoder",
        "cuda_graphs": bool(args.graphs and device.type == "cuda"),
        "preset": cfg.name,
        "dtype": cfg.dtype,
        "params": sum(p.numel() for p in dec.parameters()),
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
        "floor_tok_s": FLOOR_TOK_S,
    }
    if device.type == "cuda":
        meta["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result = {"meta": meta, "prefill": prefill, "decode": decode}
    name = args.name or f"decoder-{cfg.name}-{device.type}"
    benchutil.write_json(args.out / f"{name}.json", result)
    plot(result, args.out / f"{name}.png")
    print_tables(result)
    print(f"\nwrote {args.out / name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
