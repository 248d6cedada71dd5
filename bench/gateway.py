"""tandem-bench-gateway: what the gateway adds to the time to first audio, against direct gRPC.

    tandem-bench-gateway --triton HOST:GRPC_PORT [--gateway http://HOST:PORT] [--streams 100]

One stream at a time (added latency, not queueing), the same greedy request each way, interleaved
so drift hits every way alike:

- `direct_grpc`: tritonclient's gRPC stream (`TTSClient`), request sent to first response.
- `gateway_stream`: the gateway's own path in this process (`Gateway.respond`: its aio gRPC client,
  one stream per request, the framing), entry to the first body bytes. No HTTP: the HTTP caller's
  request cannot carry prompt rows, and a model without a text front end takes no text.
- `gateway_http`: the OpenAI SDK against a running gateway (`--gateway`), request to first audio
  bytes; only when the served model publishes a TEXT input (else recorded as skipped, with why).
- `http_floor`: `GET /v1/models` on that gateway (the HTTP stack's own round trip, no Triton).

Prints a table and writes JSON (commit, device, every sample) to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.bench.util import format_table, provenance, quantile, write_json
from tandem.gateway.app import Gateway, GatewaySettings
from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.client import TTSClient
from tandem.gateway.stream import StreamRequest, new_stream_id, prompt_inputs
from tandem.wire import contract as wire


def _stats(samples_s: list[float]) -> dict[str, float | int]:
    ms = [s * 1e3 for s in samples_s]
    return {
        "p50_ms": quantile(ms, 0.5),
        "p99_ms": quantile(ms, 0.99),
        "mean_ms": float(np.mean(ms)),
        "n": len(ms),
    }


async def _gateway_first_bytes(gw: Gateway, model: str, prompt: np.ndarray, params: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    req = StreamRequest(model, prompt_inputs(prompt, **params), new_stream_id())
    resp = await gw.respond(req, Framer(AudioFormat.PCM, StreamFormat.AUDIO, 22050), time.monotonic())
    body = resp.body_iterator
    first = await anext(body)
    elapsed = time.perf_counter() - t0
    assert len(first) > 0
    async for _ in body:  # drain: the stream ends before the next one starts
        pass
    return elapsed


def _http_text_first_bytes(base: str, model: str) -> float:
    import openai

    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    t0 = time.perf_counter()
    with sdk.audio.speech.with_streaming_response.create(
        model=model, input="Hello from the gateway benchmark.", voice="tara", response_format="pcm"
    ) as resp:
        it = resp.iter_bytes()
        next(it)
        elapsed = time.perf_counter() - t0
        for _ in it:
            pass
    return elapsed


def _http_floor(base: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        r.read()
    return time.perf_counter() - t0


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, args.vocab, size=(args.rows, args.width), dtype=np.int64)
    params = {wire.MAX_TOKENS.name: args.max_tokens, wire.TEMPERATURE.name: 0.0, wire.SEED.name: 1}
    gw = Gateway(GatewaySettings(args.triton, f"http://{args.triton.rsplit(':', 1)[0]}:8002/metrics"))
    await gw.start()
    samples: dict[str, list[float]] = {
        "direct_grpc": [],
        "gateway_stream": [],
        "gateway_http": [],
        "http_floor": [],
    }
    skipped: dict[str, str] = {}
    try:
        while gw.models is None:
            await asyncio.sleep(0.1)
        model = gw.models[args.model]
        if not args.gateway:
            skipped["gateway_http"] = skipped["http_floor"] = "no --gateway given"
        elif not model.takes_text:
            skipped["gateway_http"] = (
                f"{args.model} publishes no TEXT input: an HTTP caller's text is refused"
            )
        with TTSClient(args.triton, args.model) as client:
            for i in range(args.warmup + args.streams):
                r = client.run(prompt, **params)
                assert r.error is None, r.error
                g = await _gateway_first_bytes(gw, args.model, prompt, params)
                h = (
                    _http_text_first_bytes(args.gateway, args.model)
                    if "gateway_http" not in skipped
                    else None
                )
                f = _http_floor(args.gateway) if "http_floor" not in skipped else None
                if i < args.warmup:
                    continue
                samples["direct_grpc"].append(r.ttfa_ms / 1e3)
                samples["gateway_stream"].append(g)
                if h is not None:
                    samples["gateway_http"].append(h)
                if f is not None:
                    samples["http_floor"].append(f)
    finally:
        await gw.stop()
    figures = {k: _stats(v) for k, v in samples.items() if v}
    direct, via = figures["direct_grpc"], figures["gateway_stream"]
    added = {"p50_ms": via["p50_ms"] - direct["p50_ms"], "p99_ms": via["p99_ms"] - direct["p99_ms"]}
    return {"figures": figures, "gateway_stream_added": added, "skipped": skipped, "samples_s": samples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-gateway", description=__doc__.splitlines()[0])
    ap.add_argument("--triton", default="127.0.0.1:8001")
    ap.add_argument("--gateway", default="", help="a running tandem-gateway's base URL, for the HTTP figures")
    ap.add_argument("--model", default="tts")
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rows", type=int, default=30, help="prompt rows")
    ap.add_argument("--width", type=int, default=4, help="row width (the checked-in repository's)")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/gateway-cpu.json"))
    args = ap.parse_args(argv)
    result = asyncio.run(_run(args))
    payload = {
        **provenance(torch.device("cpu"), "tandem-bench-gateway", argv),
        "model": args.model,
        "streams": args.streams,
        **result,
    }
    write_json(args.out, payload)
    figs: dict[str, dict[str, float]] = result["figures"]
    rows = [[k, v["p50_ms"], v["p99_ms"], v["mean_ms"], v["n"]] for k, v in figs.items()]
    print(format_table(["way", "p50 ms", "p99 ms", "mean ms", "n"], rows))
    added: dict[str, float] = result["gateway_stream_added"]
    print(f"gateway stream path adds p50 {added['p50_ms']:+.2f} ms, p99 {added['p99_ms']:+.2f} ms")
    for k, why in result["skipped"].items():
        print(f"{k}: skipped ({why})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
