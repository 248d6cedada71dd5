"""tandem-perf-data: input data for Triton's perf_analyzer, and first-audio latency from its profile.

    tandem-perf-data inputs --out FILE [--triton HOST:PORT --model tts | --width W --vocab V] [--rows N]
    tandem-perf-data first-response PROFILE.json

perf_analyzer's random or zero inputs fail tandem's validation (`MAX_TOKENS = 0 is outside [1, 2048]`,
ids outside the vocabulary), so `inputs` writes valid prompts in its `--input-data` JSON format: one
sequence per stream, one step each (run with `--sequence-length 1`), PROMPT INT64 [rows, W] with ids
below the vocabulary, MAX_TOKENS, and TEMPERATURE 0 (greedy: the same work every run). W and the
vocabulary come from the model's published `row_width`/`vocab_size` (`--triton`) or are given.

perf_analyzer's latency for a streaming model is the last response's; `first-response` reads the
profile export (`--profile-export-file`) and reports, per experiment, the time from each request to
its first response (the first audio) and to its last. docs/perf_analyzer.md has the commands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from tandem.wire import contract as wire


def input_data(streams: int, rows: int, width: int, vocab: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """perf_analyzer's `--input-data` JSON: `streams` sequences of one step each."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(streams):
        prompt = rng.integers(0, vocab, size=(rows, width), dtype=np.int64)
        step = {
            wire.PROMPT.name: {"content": prompt.reshape(-1).tolist(), "shape": [rows, width]},
            wire.MAX_TOKENS.name: {"content": [max_tokens], "shape": [1]},
            wire.TEMPERATURE.name: {"content": [0.0], "shape": [1]},
        }
        data.append([step])
    return {"data": data}


def first_response_latencies(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """Per experiment of a perf_analyzer profile export: first- and last-response latency quantiles (ms)."""
    out = []
    for exp in profile.get("experiments", []):
        first, last = [], []
        for req in exp.get("requests", []):
            stamps = req.get("response_timestamps") or []
            if stamps:
                first.append((stamps[0] - req["timestamp"]) / 1e6)
                last.append((stamps[-1] - req["timestamp"]) / 1e6)
        if not first:
            continue
        row: dict[str, Any] = {**exp.get("experiment", {}), "requests": len(first)}
        for name, values in (("first_response", first), ("last_response", last)):
            for q in (50, 90, 99):
                row[f"{name}_p{q}_ms"] = round(float(np.percentile(values, q)), 2)
        out.append(row)
    return out


def _published(url: str, model: str) -> tuple[int, int]:
    import tritonclient.grpc as grpcclient

    cfg = grpcclient.InferenceServerClient(url).get_model_config(model, as_json=True)["config"]
    params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
    return int(params["row_width"]), int(params["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-perf-data", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("inputs", help="write perf_analyzer --input-data JSON with valid prompts")
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument("--triton", default="", help="read row_width/vocab_size from this server's model")
    gen.add_argument("--model", default="tts")
    gen.add_argument("--width", type=int, default=0)
    gen.add_argument("--vocab", type=int, default=0)
    gen.add_argument("--rows", type=int, default=64, help="prompt rows per stream")
    gen.add_argument("--streams", type=int, default=16, help="distinct prompts (perf_analyzer cycles them)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--seed", type=int, default=0)
    rd = sub.add_parser("first-response", help="first- and last-response latency from a profile export")
    rd.add_argument("profile", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "inputs":
        width, vocab = _published(args.triton, args.model) if args.triton else (args.width, args.vocab)
        if width <= 0 or vocab <= 0:
            ap.error("give --triton (published row_width/vocab_size) or both --width and --vocab")
        data = input_data(args.streams, args.rows, width, vocab, args.max_tokens, args.seed)
        args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(
            f"wrote {args.out}: {args.streams} prompts of [{args.rows}, {width}], "
            f"MAX_TOKENS {args.max_tokens}"
        )
        return 0
    rows = first_response_latencies(json.loads(args.profile.read_text()))
    if not rows:
        print("no request with a response in the profile", file=sys.stderr)
        return 1
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
