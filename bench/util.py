"""Shared plumbing for the `tandem-bench-*` programs: provenance, result files, tables, timing helpers.

Why one module: every benchmark must write the same provenance (commit, device, library versions, the
exact command) next to its figures, so a number quoted in docs/benchmarks/README.md can always be traced
back to the run that produced it. Benchmarks live outside the test suite; nothing here is imported by
the engines.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.settings import RateSettings

COMMIT_ENV = "TANDEM_BENCH_COMMIT"  # set by callers that run from a copy without .git (device machine)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """$TANDEM_BENCH_COMMIT when set (a copied tree whose .git is stale or absent: the device runs
    pass the commit they were sent), else HEAD of the checkout this file lives in, else "unknown"."""
    return os.environ.get(COMMIT_ENV) or _git("rev-parse", "HEAD") or "unknown"


def git_dirty() -> bool | None:
    """True when the checkout has uncommitted changes (the figures then describe HEAD plus those)."""
    status = _git("status", "--porcelain")
    return None if status is None else bool(status)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """Human-readable name of what ran the benchmark, e.g. 'NVIDIA H200' or '2 x Intel(R) Xeon(R) ...'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()} x {cpu_name()}"


def provenance(device: torch.device, prog: str, argv: Sequence[str] | None) -> dict[str, Any]:
    """The header every result file starts with; `prog argv` is recorded as the command that ran."""
    return {
        "commit": git_commit(),
        "tree_dirty": git_dirty(),
        "device": device_name(device),
        "device_type": device.type,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([prog, *(sys.argv[1:] if argv is None else argv)]),
    }


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def save_result(
    out: Path,
    name: str,
    result: dict[str, Any],
    plot: Callable[[dict[str, Any], Path], None],
    print_tables: Callable[[dict[str, Any]], None],
) -> None:
    """A bench's last act: `<out>/<name>.json`, its plot `<out>/<name>.png`, its tables on stdout."""
    write_json(out / f"{name}.json", result)
    plot(result, out / f"{name}.png")
    print_tables(result)
    print(f"\nwrote {out / name}.json and .png")


def read_json(path: Path) -> Any:
    """A result `write_json` wrote, plain or gzip-compressed (`.json.gz`: how docs/benchmarks keeps
    its large records). A `.json` path that is absent is read from `<path>.gz` beside it, so the
    commands docs/benchmarks/README.md quotes work on either form."""
    gz = path.with_name(path.name + ".gz")
    if path.suffix != ".gz" and not path.exists() and gz.exists():
        path = gz
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return json.load(fh)
    return json.loads(path.read_text(encoding="utf-8"))


def png_beside(path: Path) -> Path:
    """The plot of a result file: `x.json` or `x.json.gz` -> `x.png` (what `--replot` redraws)."""
    return (path.with_suffix("") if path.suffix == ".gz" else path).with_suffix(".png")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]); enough for the handful of repeats a benchmark takes."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))])


def summary(values_s: Sequence[float]) -> dict[str, float | int]:
    """Median / min / p90 / max in milliseconds plus the sample count."""
    ms = [v * 1e3 for v in values_s]
    return {
        "median_ms": median(ms),
        "min_ms": min(ms),
        "p90_ms": quantile(ms, 0.9),
        "max_ms": max(ms),
        "n": len(ms),
    }


def event_ms(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of `fn` on the current CUDA stream, after `warmup` untimed
    ones (CUDA events around each call, which then syncs). A captured graph: `fn` = `graph.replay`."""
    out = []
    for i in range(warmup + reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            out.append(float(start.elapsed_time(end)))
    return out


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table (also readable on a terminal)."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "| " + " | ".join("-" * w for w in widths) + " |",
    ]
    lines += ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in text]
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend, or None when matplotlib is missing (the JSON is
    still written; a PNG can be redrawn from it with `--replot`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG written", file=sys.stderr)
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path, title: str, fontsize: int = 10, dpi: int = 110) -> None:
    """Title `fig`, lay it out, write it to `path` and close it (every bench's plot ends so)."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


# The codec a preset's family speaks through, as its LM's real-time rate in rows per second: Orpheus'
# SNAC 24 kHz (7 rows per 2,048-sample frame), else the reference codec's clock (VocoderConfig).
PRESET_ROWS_PER_SECOND = {"orpheus-3b-shape": 24000 / 2048 * 7}


def floor_tok_s(preset_name: str, rtf: float = RateSettings().rtf) -> float:
    """The rate floor a stream of this preset's family must keep: its codec's real time over `rtf`
    (the engines' `rate.rtf`, 0.5 by default: 42 tok/s for the reference codec, 164.06 for Orpheus)."""
    return PRESET_ROWS_PER_SECOND.get(preset_name, VocoderConfig().rows_per_second) / rtf


def add_model_arguments(ap: argparse.ArgumentParser, fp8: bool = False) -> None:
    """`--preset`, `--device`, `--dtype` and `--rtf`, as the decoder benchmarks take them
    (`model_from_args`, `floor_tok_s`); with `fp8`, also `--dtype fp8` and `--kv-dtype` (a bench that
    builds through `build_model`)."""
    ap.add_argument("--preset", default="tiny", help="model preset (tiny, qwen3-4b-shape)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    if fp8:
        ap.add_argument(
            "--dtype",
            help="float32 | bfloat16 | float16 | fp8 (E4M3 projections, bf16 compute; tandem.model.dtype) "
            "(default: the preset's)",
        )
        ap.add_argument(
            "--kv-dtype",
            default="auto",
            choices=("auto", "fp8"),
            help="the KV pool's storage (tandem.kv.dtype)",
        )
    else:
        ap.add_argument("--dtype", help="float32 | bfloat16 | float16 (default: the preset's)")
    ap.add_argument(
        "--rtf", type=float, default=RateSettings().rtf, help="RTF target: the floor is real time over it"
    )


def shuffled_pool(
    source: ModelConfig | Decoder, n_tokens: int, page_size: int, device: torch.device, seed: int
) -> KVPool:
    """A pool for `n_tokens` in `source`'s KV layout (a decoder's names its E4M3 scales) whose free list
    hands pages out in random order, filled with random KV (`KVPool.randomize`)."""
    pages = -(-n_tokens // page_size)
    pool = KVPool(source.kv_layout(), pages, page_size, device)
    every = pool.allocate(pages)
    random.Random(seed).shuffle(every)
    pool.free(every)  # allocate() now returns pages in this shuffled order
    pool.randomize(torch.Generator(device=device).manual_seed(seed))
    return pool


def model_from_args(args: argparse.Namespace) -> tuple[torch.device, ModelConfig]:
    """The device (CUDA with an index) and the preset's config in `--dtype` (fp8: bfloat16, quantised
    by `build_model`); seeds torch with `--seed`."""
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cfg = preset(args.preset)
    if args.dtype:
        cfg = cfg.with_dtype("bfloat16" if args.dtype == "fp8" else DTYPE_ALIASES.get(args.dtype, args.dtype))
    torch.manual_seed(args.seed)
    return device, cfg


def build_model(args: argparse.Namespace, cfg: ModelConfig, device: torch.device) -> Decoder:
    """The preset's random decoder (`--seed`), quantised as `--dtype fp8` / `--kv-dtype fp8` ask."""
    dec = Decoder.random(cfg, device, seed=args.seed)
    weights, kv = args.dtype == "fp8", getattr(args, "kv_dtype", "auto") == "fp8"
    if weights or kv:
        dec.quantize_fp8(weights=weights, kv=kv)
    return dec
