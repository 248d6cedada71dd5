"""`tandem-client`: stream one request to `tts` or `tts_mono`, write a WAV, print what it took.

    tandem-client --url localhost:8001 --model tts --rows 200 --max-tokens 128 --out hello.wav
    tandem-client --text "Hello there." --voice tara --max-tokens 1200 --out tara.wav   # Orpheus

With `--text` (and optionally `--voice`) the server builds the prompt with the checkpoint's own
tokenizer and the family's template (the `TEXT` and `VOICE` inputs). Otherwise the prompt is random
ids of the model's published row width (a stand-in for a real voice reference and text), or
`--prompt FILE.npy` with an int64 [N, W] array. Prints time to first audio, tokens/s after the first
response, and the per-stage waterfall from the server's TIMINGS. Warns (on stderr; the exit status
stays 0) when the stream ran below the rate floor, the rule the unit counts in
`tandem_streams_below_floor_total`: rows/s after the first response under the model's published
`rows_per_second` over `--rtf` (0.5, the unit's default `rate.rtf`: twice real time), with the
stalls a listener playing it live would have heard.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from tandem.backend.codec.reference import write_wav
from tandem.backend.timing import FIRST_AUDIO_STAGES, waterfall
from tandem.gateway.client import TTSClient


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-client", description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--model", default="tts", help="tts (PD split) or tts_mono (monolithic)")
    ap.add_argument("--text", help="text to speak (the server tokenizes it; excludes --prompt)")
    ap.add_argument("--voice", help="with --text: the speaker, e.g. tara (the checkpoint's voices)")
    ap.add_argument("--prompt", help="int64 [N, W] .npy file; default: random rows")
    ap.add_argument("--rows", type=int, default=200, help="random prompt rows when --prompt is absent")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--voice-id")
    ap.add_argument("--out", default="out.wav", help="WAV file to write")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument(
        "--rtf", type=float, default=0.5, help="the floor's real-time factor (the unit's rate.rtf; 0.5)"
    )
    args = ap.parse_args(argv)
    if not 0 < args.rtf < float("inf"):
        ap.error(f"--rtf must be a positive number, got {args.rtf}")
    if args.text is not None and args.prompt:
        ap.error("--text and --prompt are exclusive: a request carries exactly one of TEXT and PROMPT")
    if args.voice is not None and args.text is None:
        ap.error("--voice needs --text")

    with TTSClient(args.url, args.model) as client:
        published = client.model_parameters()
        width, vocab = int(published["row_width"]), int(published["vocab_size"])
        rate = int(published["sample_rate"])
        rows_per_second = float(published["rows_per_second"])
        prompt: np.ndarray | None = None
        if args.prompt:
            prompt = np.load(args.prompt).astype(np.int64)
        elif args.text is None:
            prompt = np.random.default_rng(0).integers(0, vocab, size=(args.rows, width), dtype=np.int64)
        result = client.run(
            prompt,
            timeout_s=args.timeout,
            TEXT=args.text,
            VOICE=args.voice,
            MAX_TOKENS=args.max_tokens,
            TEMPERATURE=args.temperature,
            TOP_P=args.top_p,
            TOP_K=args.top_k,
            SEED=args.seed,
            VOICE_ID=args.voice_id,
        )
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
        return 1
    assert result.rows is not None and result.audio is not None
    write_wav(args.out, result.audio, rate)
    n, w = result.rows.shape
    print(f"model {args.model}: {n} rows x {w} ids in {result.responses} responses")
    print(f"time to first audio: {result.ttfa_ms:.1f} ms")
    print(f"tokens/s after first response: {result.tokens_per_s:.1f}")
    print(f"audio: {result.audio.shape[0] / rate:.2f} s at {rate} Hz -> {args.out}")
    stamps = dict(result.timings)
    stamps["client_first_audio"] = result.first_audio_ns or result.first_response_ns
    print("waterfall (ms):")
    total = 0.0
    for name, ms in waterfall(stamps, FIRST_AUDIO_STAGES):
        total += ms
        print(f"  {name:<32} {ms:9.2f}")
    print(f"  {'sum':<32} {total:9.2f}   (client measured {result.ttfa_ms:.2f} to first audio)")
    if result.below_floor(rows_per_second, args.rtf):
        stalls, stalled = result.playback_stalls(rate)
        print(
            f"warning: the stream ran below the rate floor: {result.tokens_per_s:.1f} rows/s after its"
            f" first response, under {rows_per_second / args.rtf:.1f} ({rows_per_second:g} rows/s of audio"
            f" at RTF {args.rtf:g}); a listener playing it live would have heard {stalls} stalls"
            f" ({stalled:.2f} s in all)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
