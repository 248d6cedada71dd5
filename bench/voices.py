"""tandem-bench-voices: what a registered voice costs — registering it, and the time to first audio
of the first and the second request with it (the second's prefix served from P's prefix cache).

    tandem-bench-voices --url HOST:GRPC_PORT --metrics-url http://HOST:METRICS_PORT/metrics \\
        [--seconds 10] [--repeats 3] [--out docs/benchmarks/voices-cpu.json]

Against a running unit whose `voices` model encodes with its codec (an Orpheus repository: SNAC):
1. registers `--repeats` voices from a `--seconds` speech-like reference at 24 kHz (WAV), timing
   each registration at the client and reading the server's decode/encode/store split; the
   physical figure is the encoder's real-time factor (encode seconds per second of audio);
2. for the first voice: `tts` requests (`--text`, `--max-tokens`, one seed) one at a time: the first
   (its prompt prefilled whole) and a second and third (the voice's prefix from P's cache; the
   metric `tandem_prefix_cache_hit_tokens_total{model="prefill"}` is read around each), then a
   built-in voice's (no prefix) for the floor: what TTFA is without any reference to prefill;
3. deletes the voices it registered.
Prints a table, writes JSON (commit, device, every figure) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from tandem.bench.reference_audio import speech_like, wav_bytes
from tandem.bench.util import format_table, provenance, pyplot, write_json
from tandem.gateway.client import TTSClient
from tandem.gateway.voice_client import VoiceClient

HIT = "tandem_prefix_cache_hit_tokens_total"


def cache_hits(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    pattern = rf'^{HIT}{{[^}}]*model="prefill"[^}}]*}} (\S+)$'
    return sum(float(m) for m in re.findall(pattern, text, re.MULTILINE))


def speak(url: str, voice: str, args: argparse.Namespace, metrics_url: str) -> dict[str, Any]:
    before = cache_hits(metrics_url)
    with TTSClient(url, "tts") as c:
        r = c.run(None, timeout_s=600, TEXT=args.text, VOICE=voice, MAX_TOKENS=args.max_tokens, SEED=1)
    if r.error:
        raise SystemExit(f"tandem-bench-voices: {voice}: {r.error}")
    return {"voice": voice, "ttfa_ms": r.ttfa_ms, "cached_tokens": cache_hits(metrics_url) - before}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-voices", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="Triton's gRPC endpoint, HOST:PORT")
    ap.add_argument("--metrics-url", required=True)
    ap.add_argument("--seconds", type=float, default=10.0, help="the reference's length")
    ap.add_argument("--repeats", type=int, default=3, help="registrations timed")
    ap.add_argument("--text", default="Hey there, this is a new sentence in the registered voice.")
    ap.add_argument(
        "--max-tokens", type=int, default=28, help="rows per speech request (2 frames sound first)"
    )
    ap.add_argument("--builtin", default="tara", help="a built-in voice, for the TTFA floor")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/voices-cpu.json"))
    args = ap.parse_args(argv)

    data = wav_bytes(speech_like(args.seconds, 24000, seed=3), 24000)
    names = [f"bench{os.getpid()}-{i}" for i in range(args.repeats)]
    transcript = "Hello there, this is how I sound when I read a sentence aloud for a while."
    registrations = []
    with VoiceClient(args.url) as vc:
        try:
            for name in names:
                t0 = time.perf_counter()
                got = vc.register(name, transcript, data)
                wall = time.perf_counter() - t0
                registrations.append(
                    {"name": name, "wall_s": wall, **got["seconds"], "frames": got["frames"]}
                )
                print(f"registered {name}: {wall:.2f} s ({got['frames']} frames)", file=sys.stderr)
            requests = [speak(args.url, names[0], args, args.metrics_url) for _ in range(3)]
            floor = [speak(args.url, args.builtin, args, args.metrics_url) for _ in range(2)]
        finally:
            for name in names:
                try:
                    vc.delete(name)
                except Exception as exc:
                    print(f"could not delete {name}: {exc}", file=sys.stderr)
    audio_tokens = registrations[0]["frames"] * 7
    encode_rtf = [r["encode_s"] / args.seconds for r in registrations]
    rows = [
        *(["register", r["name"], r["wall_s"] * 1e3, f"encode {r['encode_s']:.2f} s"] for r in registrations),
        *(
            ["speak", f"voice #{i + 1}", q["ttfa_ms"], f"cached {q['cached_tokens']:.0f}"]
            for i, q in enumerate(requests)
        ),
        *(
            ["speak", f"{args.builtin} #{i + 1}", q["ttfa_ms"], f"cached {q['cached_tokens']:.0f}"]
            for i, q in enumerate(floor)
        ),
    ]
    print(format_table(["what", "which", "ms", "note"], rows))
    print(
        f"encoder real-time factor {min(encode_rtf):.2f}-{max(encode_rtf):.2f} s per s of audio; "
        f"reference {audio_tokens} audio tokens"
    )
    payload = {
        **provenance(torch.device("cpu"), "tandem-bench-voices", argv),
        "url": args.url,
        "reference_s": args.seconds,
        "reference_audio_tokens": audio_tokens,
        "registrations": registrations,
        "encode_s_per_audio_s": encode_rtf,
        "speech": {"text": args.text, "max_tokens": args.max_tokens, "voice": requests, "builtin": floor},
    }
    write_json(args.out, payload)
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        a.bar(
            [f"#{i + 1}" for i in range(len(registrations))],
            [r["wall_s"] for r in registrations],
            label="wall",
        )
        a.bar(
            [f"#{i + 1}" for i in range(len(registrations))],
            [r["encode_s"] for r in registrations],
            label="encode",
        )
        a.axhline(args.seconds, color="grey", linestyle="--", label="reference length (real time)")
        a.set_title(f"registration of a {args.seconds:g} s reference")
        a.set_ylabel("s")
        a.legend()
        labels = [f"voice #{i + 1}" for i in range(len(requests))] + [
            f"{args.builtin} #{i + 1}" for i in range(len(floor))
        ]
        b.bar(labels, [q["ttfa_ms"] for q in [*requests, *floor]])
        b.set_title("time to first audio (tts)")
        b.set_ylabel("ms")
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=100)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
