"""`tandem-bench-decode-loop`: D's decode loop alone (no server, no transfer) — how busy it keeps the
device, serial against pipelined, and how well the start-up seed predicts its steps.

    tandem-bench-decode-loop --preset tiny --device cpu --out docs/benchmarks
    tandem-bench-decode-loop --preset qwen3-4b-shape --device cuda --dtype bfloat16 \\
        --batches 8,32,64,96 --context 1024,2048 --host-ms 0,3 --calibrate --out results/

What runs: one `DecodeBatch` (what D and the monolithic engine build: CUDA graphs where available,
paged attention, sampling with temperature 0.8 / top-p 0.95, under `--grammar`'s audio-token grammar:
`orpheus` for the Orpheus preset, whose steps then compute the head's grammar span and sample over
each row's 4,097 legal ids, as D's do) over a pool of shuffled pages filled with
random KV. For each (batch B, context C, host work H, mode) it adds B streams whose prompts of C
tokens are already in the pool and runs the loop to their end:

* `serial`: `DecodeBatch.step()` (queue a step, wait for it, hand its rows out: the loop before
  device-side token feedback);
* `pipelined`: `DecodeBatch.advance()` (queue step n+1 from step n's rows on the device, then wait
  for step n), what D runs now.

After each loop turn the host spins for H ms holding the GIL (`--host-ms`): D's own work per turn
(taking admitted streams, polling transfers, Triton's response sends) — the pipeline hides it while it
is shorter than a step. Figures per configuration, over the steps after `--warmup`:

* `period`: wall time between consecutive finished steps (what each stream's rate sees);
* `device`: the device time of one step (CUDA events around its queued work; CPU: its forward);
* `busy`: summed device time over summed periods (the figure `tandem-bench` reads from D's
  `tandem_device_busy_seconds_total` under load);
* `join`: `--probes` extra streams become ready at random moments of the timed steps (as a stream
  whose KV was just verified does in D) and join when the loop next takes joiners (after its
  `advance()`/`step()`, where D polls its transfers); ready -> first chunk (4 rows), median. What
  pipelining costs a newcomer: the step already queued when it joins is not its;
* with `--calibrate`, `predicted`: the step-time model D seeds at start-up
  (`backend/engines/decode/calibration.py`, the same points and steps D times) predicting this
  configuration's period; `error` = predicted / measured - 1 (positive: conservative).

Writes <out>/<name>.json (provenance + figures) and <out>/<name>.png; `--replot FILE.json` redraws.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.codec.reference import ChunkPolicy
from tandem.backend.engines.batch import DecodeBatch, FinishedStep
from tandem.backend.engines.decode import calibration
from tandem.backend.engines.stream import Chunk
from tandem.backend.errors import TandemError
from tandem.backend.generation.grammar import GRAMMAR_NAMES, Grammar
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.model.decoder import Decoder
from tandem.backend.scheduling.step_model import StepTimeModel
from tandem.bench import util as benchutil

MODES = ("serial", "pipelined")


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


class _Sink:
    """Counts rows; makes each chunk's rows contiguous, as a response tensor would; notes when the
    first chunk came (the probes' figure)."""

    def __init__(self) -> None:
        self.rows = 0
        self.error: TandemError | None = None
        self.first_chunk_s: float | None = None

    def emit(self, chunk: Chunk) -> None:
        if self.first_chunk_s is None:
            self.first_chunk_s = time.perf_counter()
        self.rows += len(np.ascontiguousarray(chunk.rows))

    def fail(self, error: TandemError) -> None:
        self.error = error

    def cancelled(self) -> bool:
        return False


def _spin(ms: float) -> None:
    """Python work holding the GIL for `ms` (a sleep would release it and hide the cost)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def run_loop(
    batch: DecodeBatch,
    b: int,
    context: int,
    steps: int,
    warmup: int,
    host_ms: float,
    mode: str,
    seed: int,
    probes: int = 0,
    grammar: Grammar = Grammar.NONE,
) -> dict[str, Any]:
    """B streams of `context` tokens through `batch` to their end in `mode`; the figures of the steps
    after `warmup`. Periods are wall time between consecutive finished steps as the loop saw them.

    `probes` extra streams (4 rows: the first chunk) become ready at random moments of the timed
    steps, as a stream whose KV was just verified does in D; each joins the next time the loop takes
    joiners (after a turn's step, where D polls its transfers). `join_ms` is ready -> first chunk."""
    rows = warmup + steps + 2  # row 0 stands for P's; the pipelined loop's last step is drained, untimed
    sinks = [_Sink() for _ in range(b)]
    rng = np.random.default_rng(seed)
    for i in range(b):
        calibration.add_stream(batch, seed + i, seed + i, context, rows, sinks[i], rng, grammar)
    probe_turns = (
        sorted(rng.choice(range(warmup + 1, warmup + steps - 4), size=probes, replace=False))
        if probes
        else []
    )
    pending: list[tuple[float, _Sink]] = []  # (ready at, sink) not yet joined
    joined: list[tuple[float, _Sink]] = []
    period_guess = [0.0]

    def join_ready() -> None:
        now = time.perf_counter()
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            probe = 10_000 + len(joined)
            calibration.add_stream(batch, probe, probe, context, 4, item[1], rng, grammar)
            joined.append(item)

    finishes: list[tuple[float, FinishedStep]] = []
    t0 = time.perf_counter()
    turn = 0
    while len(batch) or pending:
        if turn in probe_turns:  # ready somewhere within the coming step
            pending.append((time.perf_counter() + float(rng.uniform(0, period_guess[0])), _Sink()))
        if mode == "pipelined":
            done = batch.advance()
        else:
            batch.advance()  # nothing is queued before it: it only queues
            done = batch.drain()
        join_ready()
        if done is not None:
            finishes.append((time.perf_counter(), done))
            if len(finishes) > 1:
                period_guess[0] = finishes[-1][0] - finishes[-2][0]
        _spin(host_ms)
        turn += 1
    batch.drain()
    wall = time.perf_counter() - t0
    if not all(s.error is None and s.rows == rows for s in sinks):
        raise RuntimeError("a stream did not get all its rows")
    if not all(s.error is None and s.rows == 4 and s.first_chunk_s for _, s in joined):
        raise RuntimeError("a probe did not get its first chunk")
    join_ms = [(s.first_chunk_s - ready) * 1e3 for ready, s in joined if s.first_chunk_s is not None]
    timed = range(max(1, warmup), min(len(finishes), warmup + steps))
    period = [finishes[k][0] - finishes[k - 1][0] for k in timed]
    device = [finishes[k][1].device_s for k in timed]
    p, d = benchutil.summary(period), benchutil.summary(device)
    return {
        "mode": mode,
        "batch": b,
        "context": context,
        "host_ms": host_ms,
        "steps": len(period),
        "period_median_ms": p["median_ms"],
        "period_p90_ms": p["p90_ms"],
        "device_median_ms": d["median_ms"],
        "busy": sum(device) / sum(period),
        "tok_s_per_stream": 1e3 / p["median_ms"],
        "meets_floor": 1e3 / p["median_ms"] >= batch.rate_floor,
        "join_ms_median": benchutil.median(join_ms) if join_ms else None,
        "join_ms_samples": join_ms,
        "wall_s": wall,
        "period_samples_ms": [x * 1e3 for x in period],
        "device_samples_ms": [x * 1e3 for x in device],
        "step_contexts": [finishes[k][1].context for k in timed],
    }


def calibrate(
    batch: DecodeBatch, max_batch: int, max_context: int, steps: int, grammar: Grammar = Grammar.NONE
) -> dict[str, Any]:
    """What D does at start-up (`DecodeEngine._calibrate`): time the plan, fit the seeded model."""
    pool = batch.pool
    plan = calibration.points(
        max_batch, max_context, pool.num_free_pages * pool.page_size, steps, pool.page_size
    )
    t0 = time.perf_counter()
    timed = calibration.time_steps(batch, plan, steps, grammar=grammar)
    took = time.perf_counter() - t0
    model = StepTimeModel()
    model.seed([(f.batch, f.context, f.seconds) for f in timed])
    return {
        "plan": [[p.batch, p.context] for p in plan],
        "steps_per_point": steps,
        "seconds": took,
        "coef_ms": None if model.coef is None else [float(c) * 1e3 for c in model.coef],
        "samples": [[f.batch, f.context, f.seconds * 1e3] for f in timed],
        "model": model,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    plt = benchutil.pyplot()
    if plt is None:
        return
    runs, meta = result["runs"], result["meta"]
    contexts = sorted({r["context"] for r in runs})
    hosts = sorted({r["host_ms"] for r in runs})
    loops = sorted({r["mode"] for r in runs})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for ctx in contexts:
        for h in hosts:
            for mode in loops:
                pts = sorted(
                    (r for r in runs if r["context"] == ctx and r["host_ms"] == h and r["mode"] == mode),
                    key=lambda r: r["batch"],
                )
                if not pts:
                    continue
                style = "--" if mode == "serial" else "-"
                label = f"{mode}, ctx {ctx}, host {h:g} ms"
                xs = [r["batch"] for r in pts]
                axes[0].plot(xs, [100 * r["busy"] for r in pts], style, marker="o", label=label)
                axes[1].plot(xs, [r["period_median_ms"] for r in pts], style, marker="o", label=label)
                joins = [
                    (x, r["join_ms_median"]) for x, r in zip(xs, pts, strict=True) if r.get("join_ms_median")
                ]
                if joins:
                    axes[2].plot(*zip(*joins, strict=True), style, marker="o", label=label)
    axes[0].axhline(95, color="red", linestyle=":", label="95 % target")
    axes[0].set_ylabel("device busy (%)")
    floor = meta["floor_tok_s"]
    axes[1].axhline(1e3 / floor, color="red", linestyle=":", label=f"{floor:.0f} tok/s floor")
    axes[1].set_ylabel("step period, median (ms)")
    axes[2].set_ylabel("joiner ready -> first chunk, median (ms)")
    for ax in axes:
        ax.set_xlabel("decode batch (streams)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"decode loop, {meta['preset']} {meta['dtype']} on {meta['device']} (commit {meta['commit'][:10]})",
    )


def print_tables(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(f"\ndecode loop, {meta['preset']} {meta['dtype']} on {meta['device']}, commit {meta['commit']}\n")
    rows = []
    for r in result["runs"]:
        pred = r.get("predicted_ms")
        join = r.get("join_ms_median")
        rows.append(
            [
                r["mode"],
                r["batch"],
                r["context"],
                r["host_ms"],
                r["period_median_ms"],
                r["period_p90_ms"],
                r["device_median_ms"],
                f"{100 * r['busy']:.1f}",
                r["tok_s_per_stream"],
                "-" if join is None else join,
                "-" if pred is None else pred,
                "-" if pred is None else f"{100 * (pred / r['period_median_ms'] - 1):+.1f} %",
            ]
        )
    heads = ["mode", "batch", "context", "host ms", "period ms", "p90 ms", "device ms", "busy %"]
    heads += ["tok/s", "join ms"]
    print(benchutil.format_table([*heads, "predicted ms", "error"], rows))
    cal = result.get("calibration")
    if cal:
        print(
            f"\nstart-up calibration: {len(cal['samples'])} timed steps at {cal['plan']} in "
            f"{cal['seconds']:.1f} s; model (a, b, c) = {cal['coef_ms']} ms"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-decode-loop", description=__doc__.split("\n")[0])
    benchutil.add_model_arguments(ap)
    ap.add_argument("--batches", type=_ints, default=[8, 32, 64], help="decode batch sizes, comma list")
    ap.add_argument("--context", type=_ints, default=[1024], help="tokens of KV per stream, comma list")
    ap.add_argument("--host-ms", type=_floats, default=[0.0, 2.0], help="host work per loop turn, comma list")
    ap.add_argument("--modes", default=",".join(MODES), help="serial,pipelined")
    ap.add_argument("--probes", type=int, default=6, help="joining streams timed per configuration")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-graphs", action="store_true", help="eager decode steps on CUDA")
    ap.add_argument("--calibrate", action="store_true", help="seed D's step model as at start-up and compare")
    ap.add_argument("--calibrate-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--grammar",
        choices=sorted(GRAMMAR_NAMES),
        default="off",
        help="the audio-token grammar the streams sample under (orpheus: an Orpheus-vocabulary preset)",
    )
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for <name>.json and <name>.png")
    ap.add_argument("--name", help="file stem (default: decode-loop-<preset>-<device type>)")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing result JSON")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes takes a comma list of {', '.join(MODES)}")
    if args.steps < 2 or args.warmup < 1:
        ap.error("--steps must be >= 2 and --warmup >= 1")
    if args.probes < 0 or (args.probes and args.steps - 5 < args.probes):
        ap.error("--probes must be >= 0 and at most --steps - 5 (one per timed turn, away from the end)")
    if args.replot is not None:
        saved = benchutil.read_json(args.replot)
        plot(saved, benchutil.png_beside(args.replot))
        print_tables(saved)
        return 0

    device, cfg = benchutil.model_from_args(args)
    t0 = time.perf_counter()
    dec = Decoder.random(cfg, device, seed=args.seed)
    max_b, max_ctx = max(args.batches), max(args.context)
    rows = args.warmup + args.steps + 2
    pages = max_b * -(-(max_ctx + rows) // args.page_size) + 2  # + the graphs' scratch page
    pages += args.probes * -(-(max_ctx + 4) // args.page_size)  # the joining streams
    pool = benchutil.shuffled_pool(cfg, pages * args.page_size, args.page_size, device, args.seed)
    floor = benchutil.floor_tok_s(args.preset, args.rtf)
    graphs = device.type == "cuda" and not args.no_graphs
    batch = DecodeBatch(
        dec,
        pool,
        ChunkPolicy(),
        RecordingMetrics(),
        floor,
        cuda_graphs=graphs,
        max_batch=max_b + args.probes,
    )  # room for the probes: a batch over max_batch would run the eager step
    setup_s = time.perf_counter() - t0

    grammar = GRAMMAR_NAMES[args.grammar]
    cal = calibrate(batch, max_b, max_ctx, args.calibrate_steps, grammar) if args.calibrate else None
    if cal is not None:  # the calibration zeroed the pool: random KV again for the timed runs
        gen = torch.Generator(device=device).manual_seed(args.seed + 1)
        for layer in range(pool.kv.shape[0]):
            pool.kv[layer].normal_(0.0, 1.0, generator=gen)
    runs = []
    for ctx in args.context:
        for b in args.batches:
            for h in args.host_ms:
                for mode in modes:
                    r = run_loop(
                        batch, b, ctx, args.steps, args.warmup, h, mode, args.seed, args.probes, grammar
                    )
                    if cal is not None:
                        ctxs = r["step_contexts"]
                        r["predicted_ms"] = cal["model"].predict(b, int(np.median(ctxs))) * 1e3
                    runs.append(r)
                    print(
                        f"  {mode:9s} batch {b:3d} context {ctx} host {h:g} ms: period "
                        f"{r['period_median_ms']:.2f} ms, device {r['device_median_ms']:.2f} ms, "
                        f"busy {100 * r['busy']:.1f} %",
                        file=sys.stderr,
                        flush=True,
                    )
    meta = {
        **benchutil.provenance(device, "tandem-bench-decode-loop", argv),
        "benchmark": "decode-loop",
        "preset": cfg.name,
        "dtype": cfg.dtype,
        "cuda_graphs": graphs,
        "paged_attention": dec.paged_attention,
        "page_size": args.page_size,
        "page_order": "shuffled",
        "sampling": {"temperature": 0.8, "top_p": 0.95, "grammar": args.grammar},
        "steps": args.steps,
        "warmup": args.warmup,
        "setup_s": setup_s,
        "floor_tok_s": floor,
        "host_work": "python spin holding the GIL after every loop turn",
    }
    if device.type == "cuda":
        meta["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    result: dict[str, Any] = {"meta": meta, "runs": runs}
    if cal is not None:
        result["calibration"] = {k: v for k, v in cal.items() if k != "model"}
    name = args.name or f"decode-loop-{cfg.name}-{device.type}"
    benchutil.save_result(args.out, name, result, plot, print_tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
