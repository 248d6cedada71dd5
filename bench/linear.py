"""`tandem-bench-linear`: the decode step's projections alone, against HBM bandwidth.

    python -m tandem.bench.linear --preset qwen3-4b-shape --out $OUT      # on the device (CUDA)

For each projection of a preset (the fused QKV, o_proj, the fused gate-up, down_proj and the head) and
each row count (`--rows`: a decode batch), times y = x . W^T through every `--backends` entry:
`cublas` (torch's F.linear, its default BLAS), `cublaslt` (F.linear with
`torch.backends.cuda.preferred_blas_library("cublaslt")`) and `gemv` (csrc/gemv.cu through
`tandem.csrc.linear`, for rows up to its kernel's limit). A call is one replay of a CUDA graph of
`--calls` calls over `--calls` different weight copies (so no weight is served from the 60 MB L2)
divided by `--calls`; median of `--reps` replays. Bytes: the weight read once (x and y, a few KiB, are
left out), so `hbm_fraction` = weight bytes / time / `--hbm-tb-s`. The GEMV's outputs are checked
against F.linear's (float32 reference; bf16 tolerance) before timing.
Writes <out>/<name>.json and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tandem.backend.model.config import ModelConfig, preset
from tandem.bench import util as benchutil
from tandem.csrc import kv_cuda
from tandem.csrc import linear as gemv_linear


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of the decode step's GEMMs: weights [N, K]."""
    hd = cfg.head_dim
    return [
        ("qkv", (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, cfg.hidden_size),
        ("o_proj", cfg.hidden_size, cfg.num_heads * hd),
        ("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size),
        ("down", cfg.hidden_size, cfg.intermediate_size),
        ("head", cfg.row_width * cfg.vocab_size, cfg.hidden_size),
    ]


def _graph_ms(fn: Callable[[int], torch.Tensor], copies: int, args: argparse.Namespace) -> list[float]:
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(args.calls):
            fn(i % copies)
    return [t / args.calls for t in benchutil.event_ms(graph.replay, args.warmup, args.reps)]


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = preset(args.preset)
    device = torch.device(args.device)
    dtype = getattr(torch, benchutil.DTYPE_ALIASES.get(args.dtype, args.dtype))
    gen = torch.Generator(device=device).manual_seed(0)
    before = torch.backends.cuda.preferred_blas_library()  # restored after each timed backend
    results = []
    for name, n, k in shapes(cfg):
        wbytes = n * k * torch.empty((), dtype=dtype).element_size()
        # Enough copies that they do not fit the L2 together (>= 4 x 60 MB), at most --calls.
        copies = max(1, min(args.calls, -(-4 * 60_000_000 // wbytes)))
        weights = [torch.randn(n, k, generator=gen, device=device).to(dtype) * k**-0.5 for _ in range(copies)]
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen, device=device).to(dtype)
            for backend in args.backends:
                if backend == "gemv":
                    if not gemv_linear.gemv_runs(x, weights[0], max_rows=8):
                        continue
                    want = F.linear(x.float(), weights[0].float())
                    got = gemv_linear.linear(x, weights[0], max_rows=8).float()
                    err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
                    if err > 2e-2:
                        raise SystemExit(
                            f"gemv {name} rows {rows}: relative error {err:.3g} against F.linear"
                        )

                    def call(i: int, x: torch.Tensor = x, ws: list[torch.Tensor] = weights) -> torch.Tensor:
                        return gemv_linear.linear(x, ws[i], max_rows=8)
                else:
                    torch.backends.cuda.preferred_blas_library(
                        "cublaslt" if backend == "cublaslt" else "cublas"
                    )

                    def call(i: int, x: torch.Tensor = x, ws: list[torch.Tensor] = weights) -> torch.Tensor:
                        return F.linear(x, ws[i])

                ms = _graph_ms(call, copies, args)
                torch.backends.cuda.preferred_blas_library(before)
                s = benchutil.summary([t / 1e3 for t in ms])
                tb_s = wbytes / (s["median_ms"] / 1e3) / 1e12
                results.append(
                    {
                        "gemm": name,
                        "n": n,
                        "k": k,
                        "rows": rows,
                        "backend": backend,
                        "weight_bytes": wbytes,
                        **s,
                        "tb_s": tb_s,
                        "hbm_fraction": tb_s / args.hbm_tb_s,
                    }
                )
        del weights
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-linear", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-4b-shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", type=_ints, default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--backends", default="cublas,cublaslt,gemv")
    ap.add_argument("--reps", type=int, default=10, help="timed replays")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--hbm-tb-s", type=float, default=4.8)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--name", help="file stem (default: linear-<preset>)")
    args = ap.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - {"cublas", "cublaslt", "gemv"}
    if unknown:
        ap.error(f"unknown backends {sorted(unknown)}; known: cublas, cublaslt, gemv")
    if not torch.cuda.is_available() or kv_cuda.module() is None:
        print(f"needs CUDA and the built kernels ({kv_cuda.build_info()})", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "meta": benchutil.provenance(torch.device(args.device), "tandem-bench-linear", argv)
    }
    result["meta"].update(preset=args.preset, dtype=args.dtype, hbm_tb_s=args.hbm_tb_s)
    result["results"] = run(args)
    benchutil.write_json(args.out / f"{args.name or 'linear-' + args.preset}.json", result)
    print(
        benchutil.format_table(
            ["gemm", "N", "K", "rows", "backend", "median us", "TB/s", "HBM fraction"],
            [
                [
                    r["gemm"],
                    r["n"],
                    r["k"],
                    r["rows"],
                    r["backend"],
                    r["median_ms"] * 1e3,
                    r["tb_s"],
                    r["hbm_fraction"],
                ]
                for r in result["results"]
            ],
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
