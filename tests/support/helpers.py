from __future__ import annotations

import queue
import re
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient

from tandem.gateway.client import TTSClient, build_inputs, next_stream_id

TINY_W, TINY_V, SPR = 4, 1024, 1050  # published by the checked-in repository (tiny preset)


def prompt(rows: int, seed: int = 0, width: int = TINY_W) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY_V, size=(rows, width), dtype=np.int64)


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of every sample of `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^(\w+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found:
        raise KeyError(f"{name}{labels} not in metrics")
    return total


def wait_metric(url: str, name: str, predicate, timeout_s: float = 20.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout_s
    value = float("nan")
    while time.monotonic() < deadline:
        try:
            value = metric_value(metrics_text(url), name, **labels)
            if predicate(value):
                return value
        except KeyError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{name}{labels} = {value} did not reach the expected value in {timeout_s} s")


def settled_metric(
    url: str, name: str, timeout_s: float = 20.0, absent: float | None = None, **labels: str
) -> float:
    """A counter's value once it stops moving: two reads a worker heartbeat (1 s) and more apart
    agree. Engine workers' counters reach Triton on their next heartbeat, so a read right after a
    request can miss it and a later delta would count it. `absent`: the value of a series that does
    not exist yet (None: a KeyError)."""

    def read() -> float:
        try:
            return metric_value(metrics_text(url), name, **labels)
        except KeyError:
            if absent is None:
                raise
            return absent

    deadline = time.monotonic() + timeout_s
    last = read()
    while time.monotonic() < deadline:
        time.sleep(1.5)
        value = read()
        if value == last:
            return value
        last = value
    raise AssertionError(f"{name}{labels} kept moving for {timeout_s} s (last {last})")


def run(url: str, model: str, p: np.ndarray, **params) -> object:
    with TTSClient(url, model) as c:
        return c.run(p, **params)


def call(url: str, model: str, inputs, sequence: bool, timeout_s: float = 30.0):
    """All responses (as dicts of numpy outputs) of one request, or the error text."""
    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result=None, error=None: q.put((result, error)))
    kw = {"sequence_id": next_stream_id(), "sequence_start": True, "sequence_end": True} if sequence else {}
    client.async_stream_infer(model, inputs, enable_empty_final_response=True, **kw)
    out, error = [], None
    deadline = time.monotonic() + timeout_s
    while True:
        result, err = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if err is not None:
            error = str(err)
            break
        resp = result.get_response()
        if resp.outputs:
            out.append({o.name: result.as_numpy(o.name) for o in resp.outputs})
        if resp.parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return out, error


def handoff(url: str, rows: int = 40, max_tokens: int = 8) -> str:
    out, err = call(url, "prefill", build_inputs(prompt(rows), MAX_TOKENS=max_tokens, TEMPERATURE=0.0), True)
    assert err is None, err
    return out[0]["HANDOFF"][0].decode()


def decode(url: str, text: str):
    t = grpcclient.InferInput("HANDOFF", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return call(url, "decode", [t], True)


# bad prompts and parameters of `tts` and `tts_mono`: (case, make -> (prompt, params), what the error names)
BAD_PROMPTS = [
    ("empty prompt", lambda: (np.zeros((0, TINY_W), np.int64), {}), "0 rows"),
    ("id over vocab", lambda: (np.full((5, TINY_W), TINY_V, np.int64), {}), "outside the vocabulary"),
    ("negative id", lambda: (np.full((5, TINY_W), -1, np.int64), {}), "outside the vocabulary"),
    ("oversized prompt", lambda: (prompt(5000), {}), "limit"),
    ("max tokens 0", lambda: (prompt(5), {"MAX_TOKENS": 0}), "MAX_TOKENS"),
    ("max tokens huge", lambda: (prompt(5), {"MAX_TOKENS": 10**6}), "MAX_TOKENS"),
    ("nan temperature", lambda: (prompt(5), {"TEMPERATURE": float("nan")}), "TEMPERATURE"),
    ("negative temperature", lambda: (prompt(5), {"TEMPERATURE": -1.0}), "TEMPERATURE"),
    ("top_p zero", lambda: (prompt(5), {"TOP_P": 0.0}), "TOP_P"),
    ("top_k negative", lambda: (prompt(5), {"TOP_K": -3}), "TOP_K"),
]
