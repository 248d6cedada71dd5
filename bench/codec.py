"""`tandem-bench-codec`: SNAC at scale — one batched decode call over the chunks of many streams.

For each number of streams S, the vocoder's steady-state call: S windows of `lookback + chunk +
lookahead` frames (the chunks D cuts once they have grown to `--chunk-frames`), decoded in one
`SnacCodec.decode` call, timed on the device (`--reps` calls after `--warmup`). Reported per S:
- the call's time (median, p90);
- audio seconds produced per wall second (S * chunk frames * 2048 / 24000 / call time): how many
  real-time streams the codec alone keeps up with (it must exceed S for S streams to play);
- the codec's share of a chunk's latency: a stream at the rate floor (rows_per_second / rtf) takes
  chunk rows / floor seconds to generate a chunk, then the vocoder call: call / (generation + call);
- the first chunk's call (1 + lookahead frames, the time-to-first-audio part) at the same S.

    tandem-bench-codec --snac /models/snac_24khz --device cuda --streams 1,16,64,256 --out OUT
    tandem-bench-codec --random --device cpu --streams 1,2 --reps 2 --out /tmp/codec   # CI-sized
    tandem-bench-codec --write-random /tmp/snac     # a random-weight SNAC directory, and exit

Prints a table and writes `codec.json` (commit, device, figures) into `--out`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.codec.base import CodecWindow
from tandem.backend.codec.snac import SnacCodec, snac_spec, write_random
from tandem.bench import util as benchutil

HEADERS = [
    "streams",
    "window frames",
    "call ms p50",
    "call ms p90",
    "audio s/s",
    "codec share",
    "first call ms",
    "first share",
]


def _windows(
    streams: int, lookback: int, frames: int, lookahead: int, rng: np.random.Generator
) -> list[CodecWindow]:
    """`streams` windows as D cuts them: `lookback` context, `frames` to sound, `lookahead` context."""
    n = lookback + frames + lookahead
    return [
        CodecWindow(rng.integers(0, 4096, size=(n, 7)), 100, 100 + lookback, 100 + lookback + frames)
        for _ in range(streams)
    ]


def _time_call(codec: SnacCodec, windows: list[CodecWindow], warmup: int, reps: int) -> list[float]:
    sync = torch.cuda.synchronize if codec.device.type == "cuda" else (lambda *_: None)
    for _ in range(warmup):
        codec.decode(windows)
    out = []
    for _ in range(reps):
        sync(codec.device)
        t0 = time.perf_counter()
        codec.decode(windows)  # returns host arrays: the device work and the copy back are inside
        out.append(time.perf_counter() - t0)
    return out


def streaming_snr(codec: SnacCodec, frames: int, lookback: int, lookahead: int) -> float:
    """SNR (dB) of a stream decoded one frame per chunk with this context, against SNAC's offline
    decode of the whole sequence (the worst chunking: every frame is next to a chunk edge)."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 4096, size=(frames, 7))
    ref = codec.decode([CodecWindow(codes, 0, 0, frames)])[0].astype(np.float64)
    parts = []
    for f in range(frames):
        lo, hi = max(0, f - lookback), min(frames, f + 1 + lookahead)
        parts.append(codec.decode([CodecWindow(codes[lo:hi], lo, f, f + 1)])[0])
    err = np.concatenate(parts).astype(np.float64) - ref
    return float(10 * np.log10(np.sum(ref**2) / max(np.sum(err**2), 1e-30)))


def compare_weight_norm(
    snac_dir: Path, device: torch.device, frames: list[int], reps: int
) -> list[dict[str, Any]]:
    """One window of each length decoded by SNAC as the package builds it (weight-norm
    parametrisations) and by the codec (folded), alternating call by call so both see the same load;
    median ms of `reps` calls each (after one untimed call of each), and their audio's SNR."""
    from snac import SNAC

    spec = snac_spec(snac_dir, "orpheus", 0, 0, 7)
    folded = SnacCodec(snac_dir, spec, device)
    upstream = SNAC.from_pretrained(str(snac_dir)).to(device).eval()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    out = []
    for n in frames:
        codes = np.random.default_rng(n).integers(0, 4096, size=(n, 7))
        window = [CodecWindow(codes, 0, 0, n)]
        levels = [x.to(device) for x in folded.levels(torch.from_numpy(codes[None]))]
        times: dict[str, list[float]] = {"weight_norm": [], "folded": []}
        with torch.inference_mode():
            ref = upstream.decode(levels)[0, 0].float().cpu().numpy()
            got = folded.decode(window)[0]
            for _ in range(reps):
                for name in ("weight_norm", "folded"):
                    sync(device)
                    t0 = time.perf_counter()
                    if name == "folded":
                        folded.decode(window)
                    else:
                        upstream.decode(levels).cpu()
                    times[name].append(time.perf_counter() - t0)
        err = float(np.sum((got.astype(np.float64) - ref) ** 2))
        snr = float(10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / max(err, 1e-30)))
        row = {"frames": n, **{f"{k}_ms": benchutil.median(v) * 1e3 for k, v in times.items()}, "snr_db": snr}
        out.append(row)
        print(
            f"{n} frames: weight norm {row['weight_norm_ms']:.1f} ms, folded {row['folded_ms']:.1f} ms, "
            f"SNR {snr:.0f} dB",
            file=sys.stderr,
        )
    return out


def run(args: argparse.Namespace, snac_dir: Path) -> dict[str, Any]:
    device = torch.device(args.device)
    spec = snac_spec(snac_dir, "orpheus", args.lookback, args.lookahead, 7)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    codec = SnacCodec(snac_dir, spec, device, fold=not args.weight_norm)
    floor = spec.rows_per_second / args.rtf
    chunk_s = args.chunk_frames * spec.rows_per_frame / floor  # generating one grown chunk at the floor
    first_s = (1 + args.lookahead) * spec.rows_per_frame / floor
    rng = np.random.default_rng(0)
    levels = []
    for streams in (int(x) for x in args.streams.split(",") if x):
        steady = _time_call(
            codec,
            _windows(streams, args.lookback, args.chunk_frames, args.lookahead, rng),
            args.warmup,
            args.reps,
        )
        first = _time_call(codec, _windows(streams, 0, 1, args.lookahead, rng), args.warmup, args.reps)
        call, first_call = benchutil.median(steady), benchutil.median(first)
        audio_s = streams * args.chunk_frames * spec.samples_per_frame / spec.sample_rate
        levels.append(
            {
                "streams": streams,
                "window_frames": args.lookback + args.chunk_frames + args.lookahead,
                "call_ms": {"p50": call * 1e3, "p90": float(np.percentile(steady, 90)) * 1e3},
                "audio_s_per_s": audio_s / call,
                "codec_share_of_chunk": call / (chunk_s + call),
                "first_call_ms": first_call * 1e3,
                "codec_share_of_first_chunk": first_call / (first_s + first_call),
            }
        )
        lv = levels[-1]
        print(
            f"streams {streams}: {lv['call_ms']['p50']:.1f} ms, {lv['audio_s_per_s']:.1f} audio s/s",
            file=sys.stderr,
        )
    snr = []
    for lookback, lookahead in ((0, 0), (2, 0), (2, 1), (2, 2), (3, 3)) if args.snr_frames else ():
        db = streaming_snr(codec, args.snr_frames, lookback, lookahead)
        snr.append({"lookback": lookback, "lookahead": lookahead, "snr_db": db})
        print(
            f"lookback {lookback}, lookahead {lookahead}: {db:.1f} dB against the offline decode",
            file=sys.stderr,
        )
    compare = compare_weight_norm(snac_dir, device, [2, 19], args.reps) if args.compare_weight_norm else []
    return {
        **benchutil.provenance(device, "tandem-bench-codec", args.argv),
        "weight_norm_vs_folded": compare,
        "snr_frames": args.snr_frames,
        "decoder_noise": bool(codec.noise),
        "weight_norm_folded": not args.weight_norm,
        "torch_threads": torch.get_num_threads(),
        "streaming_snr": snr,
        "codec": "snac",
        "snac_dir": str(snac_dir),
        "random_weights": args.random,
        "sample_rate": spec.sample_rate,
        "rows_per_second": spec.rows_per_second,
        "rtf": args.rtf,
        "floor_tok_s": floor,
        "lookback": args.lookback,
        "lookahead": args.lookahead,
        "chunk_frames": args.chunk_frames,
        "chunk_generation_s": chunk_s,
        "first_chunk_generation_s": first_s,
        "levels": levels,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-codec", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--snac", type=Path, help="SNAC directory (config.json + pytorch_model.bin)")
    src.add_argument("--random", action="store_true", help="the real 24 kHz config with random weights")
    src.add_argument(
        "--write-random", type=Path, metavar="DIR", help="write a random-weight SNAC dir and exit"
    )
    ap.add_argument(
        "--noise", action="store_true", help="--random/--write-random: decoder noise on (as shipped)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--streams", default="1,16,64,128,256")
    ap.add_argument(
        "--chunk-frames", type=int, default=16, help="frames a grown chunk sounds (tandem-repo: 16)"
    )
    ap.add_argument("--lookback", type=int, default=2)
    ap.add_argument("--lookahead", type=int, default=1)
    ap.add_argument("--rtf", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--snr-frames", type=int, default=12, help="frames of the streamed-vs-offline SNR check (0: skip)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument(
        "--weight-norm", action="store_true", help="keep SNAC's weight-norm parametrisations (not folded)"
    )
    ap.add_argument(
        "--compare-weight-norm",
        action="store_true",
        help="also time the first and the grown window, SNAC as built against folded, alternating",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.write_random:
        print(f"wrote {write_random(args.write_random, noise=args.noise)}")
        return 0
    if args.out is None:
        ap.error("--out is required")
    with tempfile.TemporaryDirectory() as tmp:
        snac_dir = args.snac or write_random(Path(tmp) / "snac", noise=args.noise)
        result = run(args, snac_dir)
    rows = [
        [
            lv["streams"],
            lv["window_frames"],
            lv["call_ms"]["p50"],
            lv["call_ms"]["p90"],
            lv["audio_s_per_s"],
            f"{lv['codec_share_of_chunk']:.1%}",
            lv["first_call_ms"],
            f"{lv['codec_share_of_first_chunk']:.1%}",
        ]
        for lv in result["levels"]
    ]
    print(benchutil.format_table(HEADERS, rows))
    if result["streaming_snr"]:
        snr_rows = [[r["lookback"], r["lookahead"], r["snr_db"]] for r in result["streaming_snr"]]
        print(
            benchutil.format_table(["lookback", "lookahead", "SNR dB vs offline (1-frame chunks)"], snr_rows)
        )
        if result["decoder_noise"]:
            print("(decoder noise is on in this SNAC's config: fresh noise per call bounds the SNR)")
    gen_ms, floor = result["chunk_generation_s"] * 1e3, result["floor_tok_s"]
    print(f"device {result['device']}; a chunk = {args.chunk_frames} frames, {gen_ms:.0f} ms to generate")
    print(f"at the {floor:.1f} tok/s floor; audio s/s = how many real-time streams the codec keeps up with")
    benchutil.write_json(args.out / "codec.json", result)
    print(f"wrote {args.out / 'codec.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
