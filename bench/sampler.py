"""`python -m tandem.bench.sampler`: the output head plus the sampler of one decode step, per stream,
for streams under the Orpheus grammar: the whole vocabulary (before) against the legal ids (after).

    python -m tandem.bench.sampler --preset orpheus-3b-shape --device cuda --out docs/benchmarks

What one step is here, as D's running batch runs it after the graph replay (`DecodeBatch._launch`):
the head over B hidden states, the stacking of the streams' penalty histories, the draw, and the
history's update. `whole`: the head's 156,940 rows and `sample_whole_vocabulary` (every pass over
the vocabulary, the grammar a mask: how every step ran before). `legal`: the head's rows of the
grammar's span (28,680) and `sample_on_device` over each row's 4,097 legal ids. Sampling is Orpheus'
generation_config.json's (temperature 0.6, top-p 0.8, repetition penalty 1.1); streams sit at
different slots. Both paths must draw the same tokens (checked on every timed step; a mismatch
exits 1).

Per configuration: the median over `--steps` of the step's time (CUDA: events around a
host-synchronous call, so launch gaps count; CPU: wall time) and of the host's time to queue it.
Then a least-squares fit t = a + b x B over the batches: b is this step's share of the per-stream
cost in D's step-time model (`backend/scheduling/step_model.py`). Beside it the HBM roofline of the
head's rows each path reads (bytes / `--hbm-tb-s`). The decoder has one layer (`--layers`): only its
head is used. Writes <out>/<name>.json and <out>/<name>.png.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.generation.grammar import Grammar
from tandem.backend.generation.sampling import (
    SamplingParams,
    mark_seen,
    sample_on_device,
    sample_whole_vocabulary,
    step_span,
)
from tandem.backend.model.decoder import Decoder
from tandem.bench import util as benchutil
from tandem.bench.roofline import H200_HBM_TB_S

PATHS = ("whole", "legal")
ORPHEUS_SAMPLING = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1}


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def streams(batch: int) -> tuple[list[SamplingParams], list[int]]:
    """`batch` Orpheus streams' parameters and positions: seeds differ, prompts of different lengths,
    so the streams' audio positions cover every slot."""
    params = [
        SamplingParams(seed=i, grammar=Grammar.ORPHEUS, grammar_start=40 + 13 * i, **ORPHEUS_SAMPLING)
        for i in range(batch)
    ]
    return params, [p.grammar_start + 5 * i for i, p in enumerate(params)]


def _step(
    dec: Decoder, path: str, h: torch.Tensor, views: list[torch.Tensor], params: list, positions: list
) -> torch.Tensor:
    """One step's head and sampling (rows [B, 1] on the device). `views` holds each stream's penalty
    history [1, V]; as in `DecodeBatch._launch` they are stacked, the drawn rows marked in the stack,
    and each stream keeps its row of it (written)."""
    history = torch.stack(views)
    if path == "whole":
        rows = sample_whole_vocabulary(dec.head_logits(h), params, positions, history)
    else:
        span = step_span(params, dec.cfg.vocab_size)
        rows = sample_on_device(dec.head_logits(h, span), params, positions, history, span)
    mark_seen(history, rows)
    views[:] = list(history)
    return rows


def measure(dec: Decoder, batch: int, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    """Both paths at one batch size; raises AssertionError when their tokens differ."""
    dev, cfg = dec.device, dec.cfg
    gen = torch.Generator(device=dev).manual_seed(seed + batch)
    h = torch.randn((batch, cfg.hidden_size), generator=gen, device=dev).to(cfg.torch_dtype)
    seen = torch.zeros((batch, 1, cfg.vocab_size), dtype=torch.bool, device=dev)
    audio = torch.randint(orpheus.AUDIO_BASE, orpheus.AUDIO_END, (batch, 1), generator=gen, device=dev)
    mark_seen(seen, audio)
    params, positions = streams(batch)
    out: dict[str, Any] = {"batch": batch}
    tokens: dict[str, list[torch.Tensor]] = {p: [] for p in PATHS}
    for path in PATHS:
        views = list(seen)  # both paths start from the same histories
        device_s, host_s = [], []
        for i in range(warmup + steps):
            pos = [p + i for p in positions]
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(dev)
                start.record()
            t0 = time.perf_counter()
            rows = _step(dec, path, h, views, params, pos)
            queued = time.perf_counter() - t0
            if dev.type == "cuda":
                end.record()
                end.synchronize()
                took = start.elapsed_time(end) / 1e3
            else:
                took = queued
            if i >= warmup:
                device_s.append(took)
                host_s.append(queued)
                tokens[path].append(rows.cpu())
        out[path] = {"step": benchutil.summary(device_s), "host": benchutil.summary(host_s)}
    same = all(torch.equal(a, b) for a, b in zip(tokens["whole"], tokens["legal"], strict=True))
    assert same, f"batch {batch}: the legal-ids path drew other tokens than the whole-vocabulary path"
    out["tokens_equal"] = same
    return out


def fit(runs: list[dict[str, Any]], path: str) -> dict[str, float]:
    """t = a + b x B over the runs' median step times: a in ms, b in microseconds per stream."""
    x = np.array([r["batch"] for r in runs], dtype=float)
    t = np.array([r[path]["step"]["median_ms"] for r in runs])
    if len(set(x.tolist())) < 2:
        return {"a_ms": float(t[0]), "b_us": float("nan")}
    b, a = np.polyfit(x, t, 1)
    return {"a_ms": float(a), "b_us": float(b) * 1e3}


def head_bytes(dec: Decoder) -> dict[str, int]:
    """Bytes of the head's rows each path's GEMM reads (the grammar's span: `step_span`)."""
    row = dec.cfg.hidden_size * dec.cfg.torch_dtype.itemsize * dec.cfg.row_width
    params, _ = streams(1)
    return {"whole": dec.cfg.vocab_size * row, "legal": step_span(params, dec.cfg.vocab_size).width * row}


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    roof = meta["head_roofline_us"]
    print(f"\nhead + sampler per step, {meta['preset']} on {meta['device']} (commit {meta['commit'][:10]})\n")
    rows = []
    for r in result["runs"]:
        w, lg = r["whole"], r["legal"]
        rows.append(
            [
                r["batch"],
                w["step"]["median_ms"],
                lg["step"]["median_ms"],
                w["host"]["median_ms"],
                lg["host"]["median_ms"],
                w["step"]["median_ms"] / lg["step"]["median_ms"],
            ]
        )
    headers = ["batch", "whole ms", "legal ms", "whole host ms", "legal host ms", "speed-up"]
    print(benchutil.format_table(headers, rows))
    print("\nfit t = a + b x batch (b: per stream) against the head's HBM roofline\n")
    print(
        benchutil.format_table(
            ["path", "a ms", "b us/stream", "head bytes", "head roofline us"],
            [
                [p, result["fit"][p]["a_ms"], result["fit"][p]["b_us"], meta["head_bytes"][p], roof[p]]
                for p in PATHS
            ],
        )
    )


def plot(result: dict[str, Any], path: Path) -> None:
    plt = benchutil.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = [r["batch"] for r in result["runs"]]
    for p in PATHS:
        f = result["fit"][p]
        ax.plot(
            xs,
            [r[p]["step"]["median_ms"] for r in result["runs"]],
            "o-",
            label=f"{p}: a {f['a_ms']:.3f} ms, b {f['b_us']:.2f} us/stream",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, labels=[str(x) for x in xs])
    ax.set_xlabel("streams in the step")
    ax.set_ylabel("ms per step (head + sampler)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    meta = result["meta"]
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"head + sampler, {meta['preset']} on {meta['device']} ({meta['commit'][:10]})",
        fontsize=9,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem.bench.sampler", description=__doc__.split("\n")[0])
    benchutil.add_model_arguments(ap)
    ap.set_defaults(preset="orpheus-3b-shape")
    ap.add_argument("--batches", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers to build (only the head is used)")
    ap.add_argument("--hbm-tb-s", type=float, default=H200_HBM_TB_S, help="HBM bandwidth of the roofline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for <name>.json and <name>.png")
    ap.add_argument("--name", help="file stem (default: sampler-<preset>-<device type>)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or not args.batches:
        ap.error("--steps must be >= 1, --warmup >= 0 and --batches non-empty")
    device, cfg = benchutil.model_from_args(args)
    dec = Decoder.random(replace(cfg, num_layers=args.layers), device, seed=args.seed)
    runs = []
    try:
        for b in args.batches:
            runs.append(measure(dec, b, args.steps, args.warmup, args.seed))
            r = runs[-1]
            print(
                f"  batch {b:3d}: whole {r['whole']['step']['median_ms']:.3f} ms, "
                f"legal {r['legal']['step']['median_ms']:.3f} ms",
                file=sys.stderr,
                flush=True,
            )
    except AssertionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    hb = head_bytes(dec)
    meta = {
        **benchutil.provenance(device, "python -m tandem.bench.sampler", argv),
        "benchmark": "sampler",
        "preset": cfg.name,
        "dtype": cfg.dtype,
        "sampling": ORPHEUS_SAMPLING,
        "steps": args.steps,
        "warmup": args.warmup,
        "hbm_tb_s": args.hbm_tb_s,
        "head_bytes": hb,
        "head_roofline_us": {p: hb[p] / (args.hbm_tb_s * 1e12) * 1e6 for p in PATHS},
    }
    result = {"meta": meta, "runs": runs, "fit": {p: fit(runs, p) for p in PATHS}}
    name = args.name or f"sampler-{cfg.name}-{device.type}"
    benchutil.save_result(args.out, name, result, plot, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
