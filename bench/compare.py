"""Compare waterfall stages of two or more `tandem-bench` results: a CDF per file, and p50/p99 printed.

    python -m tandem.bench.compare docs/benchmarks/admission-cpu-before.json.gz \\
        docs/benchmarks/admission-cpu-after.json.gz --stage "d_entry->d_admit" --model tts \\
        --out docs/benchmarks/admission-cpu.png

Each file's streams (every level, errors left out) give one curve of the chosen waterfall stage (or
`ttfa` for the client's time to first audio). The label of a curve is the file's name.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from tandem.bench import util as benchutil


def stage_values(result: dict, model: str, stage: str) -> list[float]:
    """The stage's milliseconds of every successful stream of `model`, all levels together."""
    levels = result["models"][model]["levels"]
    out = []
    for lv in levels:
        for r in lv["records"]:
            if r["error"] is not None:
                continue
            value = r["ttfa_ms"] if stage == "ttfa" else r["waterfall_ms"].get(stage)
            if value is not None and np.isfinite(value):
                out.append(float(value))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="tandem-bench JSON files")
    ap.add_argument("--stage", default="ttfa", help='a waterfall stage such as "d_entry->d_admit", or ttfa')
    ap.add_argument("--model", default="tts")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    curves = {}
    for path in args.results:
        values = stage_values(benchutil.read_json(path), args.model, args.stage)
        if not values:
            print(f"{path}: no {args.stage!r} values for {args.model}", file=sys.stderr)
            return 2
        name = benchutil.png_beside(path).stem  # x.json or x.json.gz -> x
        curves[name] = np.sort(values)
        p50, p99 = np.percentile(values, 50), np.percentile(values, 99)
        print(f"{name}: {len(values)} streams, {args.stage} p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    plt = benchutil.pyplot()
    if plt is None:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return 1
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs in curves.items():
        ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), drawstyle="steps-post", label=label)
    ax.set_xlabel(f"{args.stage} (ms)")
    ax.set_ylabel("fraction of streams")
    ax.set_title(f"{args.model}: {args.stage}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
