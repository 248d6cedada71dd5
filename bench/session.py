"""tandem-bench-session: first audio of speech sessions and the WebSocket cancel latency, on a gateway.

    tandem-bench-session --gateway http://HOST:PORT [--metrics-url http://HOST:8002/metrics] [--rounds 10]
        [--model tts] [--cancel-model tts]

Each round, one request at a time, interleaved so drift hits every way alike:

- `http_short`: `POST /v1/audio/speech` with one sentence (pcm), request to the first body bytes;
- `http_long`: the same with 4,096 characters (about 15 segments), request to the first body bytes;
- `ws_first_sentence`: on a configured stream-input socket, the text piece that completes the first
  sentence sent to the first binary frame (text streamed word by word, no flush yet);
- `ws_lone_sentence`: the same socket's piece that completes a lone sentence (its full stop), then
  nothing (no next text, no flush: an agent's LLM pausing for a tool call), to the first binary
  frame: the sentence quiet (`ws_context.SENTENCE_QUIET_S`, 0.2 s) plus what `ws_first_sentence`
  measures;
- `ws_cancel`: a long turn on `--cancel-model` speaking, `cancel` sent to its `turn_done`
  (the audio already on the wire is read on the way);
- `ws_cancel_engine_freed` (with `--metrics-url`): `cancel` sent to the engine that decoded the turn
  (`decode` for `tts`: the gateway's CANCEL; `tts_mono` itself) holding no stream
  (`tandem_inflight_streams` 0 on Triton's metrics, polled every 10 ms).

Prints a table and writes JSON (commit, device, each way's quantiles) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import ClientConnection, connect

from tandem.bench.util import format_table, provenance, quantile, write_json

SHORT = "Hello from the session benchmark."


def long_text(chars: int = 4096) -> str:
    out, i = "", 0
    while len(out) < chars:
        out += f"Sentence {i} of the long input keeps going, with a clause or two, until it ends here. "
        i += 1
    return out[: chars - 1] + "."


def _http_first_bytes(base: str, model: str, text: str) -> float:
    body = json.dumps({"model": model, "input": text, "voice": "tara", "response_format": "pcm"}).encode()
    req = urllib.request.Request(f"{base}/v1/audio/speech", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read(1)
        elapsed = time.perf_counter() - t0
        while r.read(1 << 16):
            pass
    return elapsed


def _ws(base: str) -> ClientConnection:
    return connect(base.replace("http://", "ws://") + "/v1/audio/speech/stream-input", max_size=None)


def _send(ws: ClientConnection, **frame: Any) -> None:
    ws.send(json.dumps(frame))


def _until_done(ws: ClientConnection) -> dict[str, Any]:
    while True:
        msg = ws.recv(timeout=600)
        if isinstance(msg, str) and (event := json.loads(msg))["type"] in {"turn_done", "error"}:
            if event["type"] == "error":
                raise RuntimeError(f"the gateway refused: {event}")
            return event


def _ws_first_sentence(base: str, model: str) -> float:
    with _ws(base) as ws:
        _send(ws, type="config", model=model, voice="tara", response_format="pcm")
        json.loads(ws.recv(timeout=60))
        for word in SHORT.split(" "):
            _send(ws, type="text", text=word + " ")
        t0 = time.perf_counter()
        _send(ws, type="text", text="And")  # the first sentence is complete now
        first = ws.recv(timeout=600)
        elapsed = time.perf_counter() - t0
        assert isinstance(first, bytes), first
        _send(ws, type="flush")
        _until_done(ws)
    return elapsed


def _ws_lone_sentence(base: str, model: str) -> float:
    with _ws(base) as ws:
        _send(ws, type="config", model=model, voice="tara", response_format="pcm")
        json.loads(ws.recv(timeout=60))
        *words, last = SHORT.split(" ")
        for word in words:
            _send(ws, type="text", text=word + " ")
        t0 = time.perf_counter()
        _send(ws, type="text", text=last)  # ends with its full stop; then the text pauses
        first = ws.recv(timeout=600)
        elapsed = time.perf_counter() - t0
        assert isinstance(first, bytes), first
        _send(ws, type="flush")
        _until_done(ws)
    return elapsed


def _inflight(metrics_url: str, engine: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "tandem_inflight_streams"
        for s in f.samples
        if s.labels.get("model") == engine
    )


def _engine_freed(metrics_url: str, engine: str, since: float, timeout_s: float = 60.0) -> float:
    """Seconds from `since` until `engine` holds no stream (RuntimeError past `timeout_s`)."""
    while _inflight(metrics_url, engine) > 0:
        if time.perf_counter() - since > timeout_s:
            raise RuntimeError(f"{engine} still holds streams {timeout_s:g} s after the cancel")
        time.sleep(0.01)
    return time.perf_counter() - since


def _ws_cancel(base: str, model: str, metrics_url: str | None) -> tuple[float, float | None]:
    """(cancel -> turn_done, cancel -> the engine holds no stream, or None without metrics)."""
    engine = "decode" if model == "tts" else model
    with _ws(base) as ws:
        _send(ws, type="config", model=model, voice="tara", response_format="pcm")
        json.loads(ws.recv(timeout=60))
        _send(ws, type="text", text=long_text(1200))
        _send(ws, type="flush")
        assert isinstance(ws.recv(timeout=600), bytes)
        if metrics_url is not None:
            assert _inflight(metrics_url, engine) > 0, f"the turn is not on {engine}"
        t0 = time.perf_counter()
        _send(ws, type="cancel")
        done = _until_done(ws)
        elapsed = time.perf_counter() - t0
        assert done["cancelled"], done
        freed = _engine_freed(metrics_url, engine, t0) if metrics_url is not None else None
    return elapsed, freed


def _stats(samples_s: list[float]) -> dict[str, float | int]:
    ms = [s * 1e3 for s in samples_s]
    return {
        "p50_ms": quantile(ms, 0.5),
        "p99_ms": quantile(ms, 0.99),
        "mean_ms": float(np.mean(ms)),
        "n": len(ms),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-session", description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", default="http://127.0.0.1:8080", help="a running tandem-gateway's base URL")
    ap.add_argument("--model", default="tts")
    ap.add_argument("--cancel-model", default="tts", help="the WebSocket cancel's model")
    ap.add_argument("--metrics-url", help="Triton's metrics: also time the engine freeing the cancelled turn")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/session-cpu.json"))
    args = ap.parse_args(argv)
    text = long_text()
    samples: dict[str, list[float]] = {
        "http_short": [],
        "http_long": [],
        "ws_first_sentence": [],
        "ws_lone_sentence": [],
        "ws_cancel": [],
        "ws_cancel_engine_freed": [],
    }
    for i in range(args.warmup + args.rounds):
        got: dict[str, float | None] = {
            "http_short": _http_first_bytes(args.gateway, args.model, SHORT),
            "http_long": _http_first_bytes(args.gateway, args.model, text),
            "ws_first_sentence": _ws_first_sentence(args.gateway, args.model),
            "ws_lone_sentence": _ws_lone_sentence(args.gateway, args.model),
        }
        got["ws_cancel"], got["ws_cancel_engine_freed"] = _ws_cancel(
            args.gateway, args.cancel_model, args.metrics_url
        )
        if i >= args.warmup:
            for k, v in got.items():
                if v is not None:
                    samples[k].append(v)
    figures = {k: _stats(v) for k, v in samples.items() if v}
    payload = {
        **provenance(torch.device("cpu"), "tandem-bench-session", argv),
        "model": args.model,
        "cancel_model": args.cancel_model,
        "rounds": args.rounds,
        "figures": figures,
    }
    write_json(args.out, payload)
    rows = [[k, v["p50_ms"], v["p99_ms"], v["mean_ms"], v["n"]] for k, v in figures.items()]
    print(format_table(["way", "p50 ms", "p99 ms", "mean ms", "n"], rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
