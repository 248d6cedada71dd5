from __future__ import annotations

import re
import time
import urllib.request

import numpy as np

from tandem.gateway.client import TTSClient

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


def run(url: str, model: str, p: np.ndarray, **params) -> object:
    with TTSClient(url, model) as c:
        return c.run(p, **params)
