"""`tandem-bench`: replay a trace against `tts` and `tts_mono` and find each one's capacity.

For each model and each concurrency C of the sweep, C clients run closed-loop over the trace (each
starts its next request when the previous one ends) for `--requests` requests. Per stream:
- rate: rows/s after the first response (the player's clock starts there);
- stalls: audio plays at `rows_per_second` from the first response on; a response that arrives
  after the buffer ran dry is a stall (the listener hears it);
- TTFA: client send -> first response with audio;
- silent lead: the responses that carried rows but no audio before the first that did (0 expected: a
  stream whose first chunk does not sound measures the sampler, not the server; an Orpheus stream
  sampled without its grammar emits an audio id one token in five on random weights). A level
  reports their sum and the streams that had any.
A level passes when no stream stalled, none failed, and every stream kept the floor. Capacity is
the largest passing C; per GPU it is divided by the GPUs the configuration uses (`--gpus`). That rule
does not see time spent waiting to start (D's rate floor queues newcomers rather than let playing
streams fall below it), so each model also reports `capacity_start_bounded`: the largest passing C
whose TTFA p95 is also within `--start-bound-ms` (default 1000).
For `tts` a level also reports D's admission latency (`d_entry -> d_admit` of the waterfall, p50/p99)
and, read from the server's metrics (`--metrics-url`), how busy D's device was during the level
(`tandem_device_busy_seconds_total` over wall time, per decode instance).

    tandem-bench --url localhost:8001 --models tts,tts_mono --gpus tts=2,tts_mono=2 \\
        --levels 8,16,24,32,40 --requests 64 --out docs/benchmarks/capacity
    tandem-bench --url localhost:8001 --smoke --out /tmp/bench      # seconds, tiny model (CI)
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.timing import FIRST_AUDIO_STAGES, waterfall
from tandem.bench import util as benchutil
from tandem.bench.trace import TraceRequest, generate, load
from tandem.gateway.client import StreamResult, TTSClient

TABLE_HEADERS = [
    "model",
    "C",
    "streams",
    "err",
    "stalls",
    "<floor",
    "silent",
    "ttfa p50 ms",
    "ttfa p95 ms",
    "later p95 ms",
    "min tok/s",
    "D admit p99 ms",
    "D busy",
    "pass",
]


def scrape(metrics_url: str, name: str, model: str) -> dict[str, float] | None:
    """{instance: value} of a metric for one model from Triton's metrics endpoint (None if it is
    unreachable or has no sample yet)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(\w+)\{([^}]*)\}\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if labels.get("model") == model:
            key = labels.get("instance", "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out or None


def device_busy(
    before: dict[str, float] | None, after: dict[str, float] | None, wall_s: float
) -> float | None:
    """Mean fraction of `wall_s` the decode instances' devices spent in steps."""
    if not after or wall_s <= 0:
        return None
    before = before or {}
    ratios = [(v - before.get(k, 0.0)) / wall_s for k, v in after.items()]
    return float(np.mean(ratios))


def stalls(result: StreamResult, rows_per_second: float) -> tuple[int, float]:
    """(number of stalls, total stalled seconds) of a stream played from its first response on."""
    if not result.response_ns:
        return 0, 0.0
    t = [ns / 1e9 for ns in result.response_ns]
    played_until = t[0] + result.response_rows[0] / rows_per_second
    count, stalled = 0, 0.0
    for arrival, rows in zip(t[1:], result.response_rows[1:], strict=True):
        if arrival > played_until:
            count += 1
            stalled += arrival - played_until
            played_until = arrival
        played_until += rows / rows_per_second
    return count, stalled


def silent_lead(result: StreamResult) -> int:
    """Responses before the first that carried audio samples (all of them when none did)."""
    for i, samples in enumerate(result.response_samples):
        if samples > 0:
            return i
    return len(result.response_samples)


def stream_record(r: StreamResult, rows_per_second: float, floor: float) -> dict[str, Any]:
    n_stalls, stalled_s = stalls(r, rows_per_second)
    stamps = dict(r.timings)
    if r.first_audio_ns or r.first_response_ns:
        stamps["client_first_audio"] = r.first_audio_ns or r.first_response_ns
    rate = r.tokens_per_s
    return {
        "error": r.error,
        "rows": 0 if r.rows is None else int(r.rows.shape[0]),
        "ttfa_ms": r.ttfa_ms,
        "rate_tok_s": rate,
        "stalls": n_stalls,
        "stalled_s": stalled_s,
        "silent_lead": silent_lead(r),
        "below_floor": bool(np.isfinite(rate) and rate < floor),
        "waterfall_ms": dict(waterfall(stamps, FIRST_AUDIO_STAGES)),
    }


def run_level(
    url: str,
    model: str,
    trace: list[TraceRequest],
    concurrency: int,
    requests: int,
    width: int,
    vocab: int,
    rows_per_second: float,
    floor: float,
    timeout_s: float,
    metrics_url: str | None = None,
    ramp_s: float = 0.0,
) -> dict[str, Any]:
    """`concurrency` closed-loop clients share `requests` requests. `ramp_s` = 0 starts every client at
    once (a burst of cold prompts: the worst case for whoever prefills); > 0 starts client k at
    k * ramp_s / concurrency, so arrivals spread like live traffic. Each record says whether it was its
    client's first request; `ttfa_ms_later` is TTFA over the others (arrivals onto a running load)."""
    counter = itertools.count()
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    t0 = time.monotonic()

    def worker(k: int) -> None:
        if ramp_s > 0:
            time.sleep(k * ramp_s / concurrency)
        first = True
        with TTSClient(url, model) as client:
            while (i := next(counter)) < requests:
                req = trace[i % len(trace)]
                prompt = req.prompt(width, vocab, i)
                r = client.run(
                    prompt,
                    timeout_s=timeout_s,
                    MAX_TOKENS=req.output_rows,
                    TEMPERATURE=0.0,
                    VOICE_ID=req.voice,
                )
                with lock:
                    records.append({**stream_record(r, rows_per_second, floor), "first_of_client": first})
                first = False

    busy_name = "tandem_device_busy_seconds_total"
    busy_before = scrape(metrics_url, busy_name, "decode") if metrics_url and model == "tts" else None
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall_s = time.monotonic() - t0
    busy = None
    if metrics_url and model == "tts":
        time.sleep(0.3)  # D publishes its counters every 0.1 s
        busy = device_busy(busy_before, scrape(metrics_url, busy_name, "decode"), wall_s)
    ok = [r for r in records if r["error"] is None]
    admit = [r["waterfall_ms"]["d_entry->d_admit"] for r in ok if "d_entry->d_admit" in r["waterfall_ms"]]
    ttfa = [r["ttfa_ms"] for r in ok]
    later = [r["ttfa_ms"] for r in ok if not r["first_of_client"]]
    rates = [r["rate_tok_s"] for r in ok if np.isfinite(r["rate_tok_s"])]
    level = {
        "concurrency": concurrency,
        "streams": len(records),
        "errors": len(records) - len(ok),
        "stalls": sum(r["stalls"] for r in ok),
        "streams_stalled": sum(1 for r in ok if r["stalls"]),
        "streams_below_floor": sum(1 for r in ok if r["below_floor"]),
        "silent_lead_responses": sum(r["silent_lead"] for r in ok),
        "streams_silent_lead": sum(1 for r in ok if r["silent_lead"]),
        "ttfa_ms": {q: float(np.percentile(ttfa, p)) for q, p in (("p50", 50), ("p95", 95), ("p99", 99))}
        if ttfa
        else {},
        "ttfa_ms_later": {
            q: float(np.percentile(later, p)) for q, p in (("p50", 50), ("p95", 95), ("p99", 99))
        }
        if later
        else {},
        "ramp_s": ramp_s,
        "rate_tok_s": {
            "min": min(rates),
            "p1": float(np.percentile(rates, 1)),
            "p50": float(np.median(rates)),
        }
        if rates
        else {},
        "d_admit_ms": {q: float(np.percentile(admit, p)) for q, p in (("p50", 50), ("p99", 99))}
        if admit
        else {},
        "waterfall_p50_ms": waterfall_p50(ok),
        "decode_device_busy": busy,
        "wall_s": wall_s,
        "records": records,
    }
    level["passed"] = (
        bool(ok) and level["errors"] == 0 and level["stalls"] == 0 and level["streams_below_floor"] == 0
    )
    return level


def waterfall_p50(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each first-audio stage's median over the streams that have it, in waterfall order."""
    stages: dict[str, list[float]] = {}
    for r in records:
        for stage, ms in r["waterfall_ms"].items():
            stages.setdefault(stage, []).append(ms)
    return {stage: float(np.median(v)) for stage, v in stages.items()}


def capacities(levels: list[dict[str, Any]], start_bound_ms: float) -> tuple[int, int]:
    """(capacity, capacity_start_bounded): the largest passing concurrency, and the largest passing one
    whose TTFA p95 is also within `start_bound_ms` (0 when none)."""
    passing = [lv for lv in levels if lv["passed"]]
    bounded = [lv for lv in passing if lv["ttfa_ms"] and lv["ttfa_ms"]["p95"] <= start_bound_ms]
    return (
        max((lv["concurrency"] for lv in passing), default=0),
        max((lv["concurrency"] for lv in bounded), default=0),
    )


def plot(result: dict[str, Any], out: Path) -> None:
    plt = benchutil.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    models = list(result["models"])
    per_gpu = [result["models"][m]["capacity_per_gpu"] for m in models]
    axes[0].bar(models, per_gpu, color=["tab:blue", "tab:orange", "tab:green"][: len(models)])
    axes[0].set_title(f"capacity per GPU (0 stalls, every stream >= {result['floor_tok_s']:g} tok/s)")
    axes[0].set_ylabel("streams per GPU")
    for m in models:
        levels = result["models"][m]["levels"]
        xs = [lv["concurrency"] for lv in levels if lv["ttfa_ms"]]
        axes[1].plot(xs, [lv["ttfa_ms"]["p95"] for lv in levels if lv["ttfa_ms"]], marker="o", label=m)
        rates = [r["rate_tok_s"] for lv in levels for r in lv["records"] if r["error"] is None]
        rates = [x for x in rates if np.isfinite(x)]
        if rates:
            axes[2].hist(rates, bins=40, alpha=0.5, label=m)
    axes[1].set_title("TTFA p95 vs concurrency")
    axes[1].set_xlabel("concurrent streams")
    axes[1].set_ylabel("ms")
    axes[1].legend()
    axes[2].axvline(result["floor_tok_s"], color="red", linestyle="--", label="floor")
    axes[2].set_title("per-stream rate (all levels)")
    axes[2].set_xlabel("tokens/s after first response")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def parse_levels(text: str, models: list[str]) -> dict[str, list[int]]:
    """`--levels`: "1,2,4" for every model, or per model "tts=32,64/tts_mono=16,24" (a model not named
    gets no levels). Raises SystemExit on anything else."""
    try:
        if "=" not in text:
            common = [int(x) for x in text.split(",") if x.strip()]
            return dict.fromkeys(models, common)
        per = {
            k.strip(): [int(x) for x in v.split(",") if x.strip()]
            for k, v in (p.split("=") for p in text.split("/"))
        }
    except ValueError:
        raise SystemExit(f"--levels: expected '1,2,4' or 'model=1,2/model=4', got {text!r}") from None
    unknown = set(per) - set(models)
    if unknown:
        raise SystemExit(f"--levels names models not in --models: {sorted(unknown)}")
    return {m: per.get(m, []) for m in models}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="localhost:8001")
    ap.add_argument(
        "--metrics-url", default="", help="Triton's metrics endpoint (default: the --url host, port 8002)"
    )
    ap.add_argument("--models", default="tts,tts_mono")
    ap.add_argument("--gpus", default="", help="GPUs per model for per-GPU capacity, e.g. tts=2,tts_mono=2")
    ap.add_argument(
        "--levels", default="1,2,4,8", help="concurrency levels: '1,2,4' for all, or 'tts=8,16/tts_mono=4,8'"
    )
    ap.add_argument("--requests", type=int, default=32, help="requests per level")
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="requests per level = rounds x concurrency (steady state: arrivals land on playing streams)",
    )
    ap.add_argument("--trace", type=Path, help="JSON-lines trace; default: a generated seed-like trace")
    ap.add_argument("--trace-requests", type=int, default=256)
    ap.add_argument(
        "--rtf", type=float, default=0.5, help="RTF target: the floor is rows_per_second / rtf (default 0.5)"
    )
    ap.add_argument(
        "--floor",
        type=float,
        default=None,
        help="floor in tok/s (default: published rows_per_second / --rtf)",
    )
    ap.add_argument(
        "--start-bound-ms",
        type=float,
        default=1000.0,
        help="capacity_start_bounded also requires TTFA p95 within this (ms)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="requests per model before the first level, not recorded (first calls are not load)",
    )
    ap.add_argument(
        "--ramp-s",
        type=float,
        default=0.0,
        help="start the clients of a level spread over this many seconds (0: all at once, a burst)",
    )
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true", help="tiny prompts and outputs, two levels (CI)")
    ap.add_argument("--out", type=Path, required=True, help="directory for bench.json and bench.png")
    args = ap.parse_args(argv)

    if args.trace:
        trace = load(args.trace)
    elif args.smoke:
        trace = generate(32, prompt_rows=(20, 60), text_rows=(4, 10), output_rows=(8, 24), voices=4)
        args.levels, args.requests = "1,2", 4
    else:
        trace = generate(args.trace_requests)
    models = [m for m in args.models.split(",") if m]
    metrics_url = args.metrics_url or f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    gpus = {k: int(v) for k, v in (kv.split("=") for kv in args.gpus.split(",") if kv)}
    levels = parse_levels(args.levels, models)

    with TTSClient(args.url, models[0]) as c:
        published = c.model_parameters()
    width, vocab = int(published["row_width"]), int(published["vocab_size"])
    rps = float(published["rows_per_second"])
    if args.floor is None:  # the server's own rule (tandem.rate.rtf): real time over the RTF target
        if not args.rtf > 0:
            ap.error("--rtf must be > 0")
        args.floor = rps / args.rtf

    result: dict[str, Any] = {
        **benchutil.provenance(torch.device("cpu"), "tandem-bench", argv),
        "floor_tok_s": args.floor,
        "rtf": rps / args.floor,
        "rows_per_second": rps,
        "warmup_requests": args.warmup,
        "trace_requests": len(trace),
        "models": {},
    }
    table = []
    for model in models:
        if args.warmup:  # first calls (graph buckets, new prompt lengths, D's step model) are not load
            run_level(
                args.url, model, trace, min(args.warmup, 8), args.warmup, width, vocab, rps, args.floor,
                args.timeout,
            )  # fmt: skip
        runs = []
        for c in levels[model]:
            n_req = args.rounds * c if args.rounds else args.requests
            lv = run_level(
                args.url,
                model,
                trace,
                c,
                n_req,
                width,
                vocab,
                rps,
                args.floor,
                args.timeout,
                metrics_url,
                ramp_s=args.ramp_s,
            )
            runs.append(lv)
            t = lv["ttfa_ms"]
            table.append(
                [
                    model,
                    c,
                    lv["streams"],
                    lv["errors"],
                    lv["stalls"],
                    lv["streams_below_floor"],
                    lv["silent_lead_responses"],
                    t.get("p50", float("nan")),
                    t.get("p95", float("nan")),
                    lv["ttfa_ms_later"].get("p95", float("nan")),
                    lv["rate_tok_s"].get("min", float("nan")),
                    lv["d_admit_ms"].get("p99", float("nan")),
                    "-" if lv["decode_device_busy"] is None else f"{lv['decode_device_busy']:.0%}",
                    "yes" if lv["passed"] else "no",
                ]
            )
            print(
                benchutil.format_table(
                    TABLE_HEADERS,
                    table[-1:],
                ),
                file=sys.stderr,
            )
            stages = ", ".join(f"{k} {v:.1f}" for k, v in lv["waterfall_p50_ms"].items())
            print(f"{model} C={lv['concurrency']} waterfall p50 ms: {stages}", file=sys.stderr)
            capacity, bounded = capacities(runs, args.start_bound_ms)
            n_gpu = gpus.get(model, 1)
            result["models"][model] = {
                "gpus": n_gpu,
                "capacity": capacity,
                "capacity_per_gpu": capacity / n_gpu,
                "start_bound_ms": args.start_bound_ms,
                "capacity_start_bounded": bounded,
                "capacity_start_bounded_per_gpu": bounded / n_gpu,
                "levels": runs,
            }
            args.out.mkdir(parents=True, exist_ok=True)
            benchutil.write_json(args.out / "bench.json", result)  # partial results survive a timeout
    print(
        benchutil.format_table(
            TABLE_HEADERS,
            table,
        )
    )
    for m, r in result["models"].items():
        per_gpu = r["capacity_per_gpu"]
        print(f"{m}: capacity {r['capacity']} streams on {r['gpus']} GPU(s) = {per_gpu:.1f} per GPU")
        print(
            f"{m}: with TTFA p95 <= {r['start_bound_ms']:g} ms too: {r['capacity_start_bounded']} streams"
            f" = {r['capacity_start_bounded_per_gpu']:.1f} per GPU"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    benchutil.write_json(args.out / "bench.json", result)
    plot(result, args.out / "bench.png")
    print(f"wrote {args.out / 'bench.json'} and bench.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
