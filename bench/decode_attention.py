"""`tandem-bench-decode-attention`: the paged decode-attention kernel alone, against HBM bandwidth.

    python -m tandem.bench.decode_attention --out $OUT          # on the device (CUDA)

One layer of a pool [2, S, KVH, HD] (bf16 unless `--dtype`), `--kv-heads` x `--head-dim` with `--group`
query heads per KV head (the 4B shape: 8 x 128, group 4). For every page size x batch x
context: B streams of `context` tokens on pages handed out in shuffled order (page size 1: every row its
own page), every stream at full length. Time: a CUDA graph of `--calls` back-to-back calls (both
kernels, the split-K partial and its merge) is replayed `--reps` times after warm-up, timed with CUDA
events; a call's time is a replay's over `--calls` (no host launch cost, as in the graphed step).
Bytes: the K and V rows of every stream read once (B x context x 2 x KVH x HD x itemsize; q, the
partials and the output are left out), so `hbm_fraction` = bytes / time / `--hbm-tb-s`.
Configurations whose KV fits in the 60 MB L2 can exceed 1.0 (repeats read it from the cache).
`--chunks` adds fixed tokens-per-split (0: the wrapper's own choice); `--kv-dtype fp8` reads an E4M3
pool (tandem.kv.dtype=fp8), whose bytes are half. The kernel is the one serving runs for the shape
(the tensor-core default, or its staged fallback for float32 and head_dim 256). `--ceiling` also
times what the memory system gives a plain stream over the same bytes: a device-to-device copy of the
pool's rows (bytes read + written, the method of the device notes) and a float32 sum over them (read
only), each the median of `--reps` runs.
Writes <out>/<name>.json and prints the table.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import torch

from tandem.bench import util as benchutil
from tandem.csrc import kv_cuda


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _slots(
    batch: int, context: int, page_size: int, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    pages_each = -(-context // page_size)
    pages = torch.randperm(batch * pages_each, generator=gen, device=device).view(batch, pages_each)
    offs = torch.arange(page_size, device=device)
    return (pages[:, :, None] * page_size + offs).reshape(batch, -1)[:, :context].contiguous()


def _graph_ms(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    args: argparse.Namespace,
    chunk: int | None = None,
) -> list[float]:
    """Milliseconds of `--reps` replays of a graph of `--calls` back-to-back calls (host launch cost
    out, as in the decoder's graphed step)."""
    scale = q.shape[-1] ** -0.5
    opts: dict[str, Any] = {"chunk": chunk}
    if kv.dtype == torch.float8_e4m3fn:
        opts["kv_scales"] = torch.full((2, kv.shape[2]), 2.0**-4, device=kv.device)
    kv_cuda.decode_attention(q, kv, slots, lengths, scale, **opts)  # eager first (attributes)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            kv_cuda.decode_attention(q, kv, slots, lengths, scale, **opts)
    return benchutil.event_ms(graph.replay, args.warmup, args.reps)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = benchutil.DTYPE_ALIASES.get(args.dtype, args.dtype)
    tdtype = getattr(torch, dtype)
    kvh, hd, group = args.kv_heads, args.head_dim, args.group
    longest = max(b * c for b in args.batches for c in args.context)
    rows = longest + max(args.page_sizes)
    kv = torch.empty(2, rows, kvh, hd, dtype=tdtype, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    kv.normal_(0.0, 1.0, generator=gen)
    if args.kv_dtype == "fp8":  # tandem.kv.dtype=fp8: E4M3 at scales 2^-4 (values of unit size)
        kv = (kv.float() * 16).to(torch.float8_e4m3fn)
    item = kv.element_size()
    out = []
    # Same order (and random draws) as one loop per axis: page size, batch, context.
    for page, b, ctx in itertools.product(args.page_sizes, args.batches, args.context):
        slots = _slots(b, ctx, page, gen, device)
        lengths = torch.full((b,), ctx, dtype=torch.long, device=device)
        q = torch.randn(b, kvh * group, hd, generator=gen, device=device).to(tdtype)
        if not kv_cuda.decode_attention_supported(q, kv):
            continue
        nbytes = b * ctx * 2 * kvh * hd * item
        for chunk in args.chunks:
            ms = _graph_ms(q, kv, slots, lengths, args, chunk or None)
            s = benchutil.summary([t / args.calls / 1e3 for t in ms])
            tb_s = nbytes / (s["median_ms"] / 1e3) / 1e12
            out.append(
                {
                    "chunk": chunk or None,
                    "page_size": page,
                    "batch": b,
                    "context": ctx,
                    "kv_bytes": nbytes,
                    **s,
                    "tb_s": tb_s,
                    "hbm_fraction": tb_s / args.hbm_tb_s,
                }
            )
    result: dict[str, Any] = {
        "shape": {"kv_heads": kvh, "head_dim": hd, "group": group, "dtype": dtype, "kv_dtype": str(kv.dtype)},
        "results": out,
    }
    if args.ceiling:
        result["ceiling"] = _ceiling(kv[:, : min(longest, rows)], args)
    return result


def _ceiling(rows: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """A plain stream over the pool's bytes: copy (read + written) and a float32 sum (read only)."""
    src = rows.contiguous()
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    out: dict[str, Any] = {"bytes": nbytes}
    for name, fn, moved in (
        ("copy", lambda: dst.copy_(src), 2 * nbytes),
        ("sum", lambda: src.sum(dtype=torch.float32), nbytes),
    ):
        s = benchutil.summary([t / 1e3 for t in benchutil.event_ms(fn, args.warmup, args.reps)])
        tb_s = moved / (s["median_ms"] / 1e3) / 1e12
        out[name] = {**s, "bytes_moved": moved, "tb_s": tb_s, "hbm_fraction": tb_s / args.hbm_tb_s}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-decode-attention", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--kv-dtype", default="auto", choices=("auto", "fp8"), help="fp8: an E4M3 KV (tandem.kv.dtype)"
    )
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--page-sizes", type=_ints, default=[1, 16])
    ap.add_argument("--batches", type=_ints, default=[1, 4, 16, 64, 256])
    ap.add_argument("--context", type=_ints, default=[256, 1024, 2048, 8192])
    ap.add_argument("--chunks", type=_ints, default=[0], help="tokens per split; 0: the wrapper's choice")
    ap.add_argument("--ceiling", action="store_true", help="also time a copy and a sum of the same bytes")
    ap.add_argument("--reps", type=int, default=10, help="timed replays")
    ap.add_argument("--calls", type=int, default=10, help="attention calls captured in one graph")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--name", default="decode-attention-h200")
    args = ap.parse_args(argv)
    if any(c < 0 for c in args.chunks):
        ap.error("--chunks must be >= 0")
    if not torch.cuda.is_available() or kv_cuda.module() is None:
        print(f"needs CUDA and the built kernels ({kv_cuda.build_info()})", file=sys.stderr)
        return 2
    result = {"meta": benchutil.provenance(torch.device(args.device), "tandem-bench-decode-attention", argv)}
    result["meta"]["hbm_tb_s"] = args.hbm_tb_s
    result.update(run(args))
    benchutil.write_json(args.out / f"{args.name}.json", result)
    print(
        benchutil.format_table(
            ["chunk", "page", "batch", "context", "median us", "TB/s", "HBM fraction"],
            [
                [
                    r["chunk"] or "auto",
                    r["page_size"],
                    r["batch"],
                    r["context"],
                    r["median_ms"] * 1e3,
                    r["tb_s"],
                    r["hbm_fraction"],
                ]
                for r in result["results"]
            ],
        )
    )
    for name, c in result.get("ceiling", {}).items():
        if isinstance(c, dict):
            print(
                f"ceiling {name}: {c['median_ms'] * 1e3:.1f} us, {c['tb_s']:.2f} TB/s, "
                f"{c['hbm_fraction']:.3f} of HBM"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
