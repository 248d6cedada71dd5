"""The unit's vital signs, read from outside: memory of the server's process tree, its stub processes,
readiness, and the engines' page and queue gauges from Triton's metrics endpoint.

`settle()` waits until every engine is idle (no stream in flight or queued, every page free, none
held) and returns a snapshot; the fuzz and abuse tests compare one taken before with one after.
Memory is the proportional set size (PSS) summed over tritonserver and its stubs: shared pages (the
python backend's shared-memory pool, torch's libraries mapped by every stub) count once, not once per
process as RSS would count them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import psutil
import tritonclient.grpc as grpcclient

from tests.support.faults import find_stub
from tests.support.helpers import metric_value, metrics_text

ENGINES = ("prefill", "decode", "tts_mono")
MODELS = ("tts", "tts_mono", "prefill", "decode", "vocoder")
STUBS = ("prefill", "decode", "tts_mono", "vocoder")


@dataclass(frozen=True)
class Vitals:
    pss_mib: float
    stubs: dict[str, int | None]  # model -> stub pid
    gauges: dict[str, float]  # "<model>.<gauge>" -> value
    ready: bool

    def idle(self, pool_pages: dict[str, int]) -> bool:
        g = self.gauges
        for model, pages in pool_pages.items():
            if g.get(f"{model}.tandem_free_pages") != pages:
                return False
            for name in ("tandem_inflight_streams", "tandem_queued_requests", "tandem_held_pages"):
                if g.get(f"{model}.{name}", 0.0) != 0.0:
                    return False
        return True


def tree_pss_mib(pid: int) -> float:
    total = 0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    return total / 2**20


def read(server_pid: int, url: str, metrics_url: str) -> Vitals:
    text = metrics_text(metrics_url)
    gauges: dict[str, float] = {}
    for model in ENGINES:
        for name in (
            "tandem_free_pages",
            "tandem_held_pages",
            "tandem_inflight_streams",
            "tandem_queued_requests",
        ):
            with contextlib.suppress(KeyError):
                gauges[f"{model}.{name}"] = metric_value(text, name, model=model)
    client = grpcclient.InferenceServerClient(url)
    try:
        ready = client.is_server_ready() and all(client.is_model_ready(m) for m in MODELS)
    except Exception:
        ready = False
    finally:
        client.close()
    stubs = {m: find_stub(server_pid, m) for m in STUBS}
    return Vitals(tree_pss_mib(server_pid), stubs, gauges, ready)


def settle(
    server_pid: int, url: str, metrics_url: str, pool_pages: dict[str, int], timeout_s: float = 45.0
) -> Vitals:
    """Wait until every engine in `pool_pages` is idle (gauges publish every ~0.1 s; P gets its pages
    back when D has pulled them or their ticket expired), then return the vitals. Raises
    AssertionError with the last reading if that does not happen within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = read(server_pid, url, metrics_url)
        if v.idle(pool_pages):
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"engines not idle after {timeout_s} s: {v.gauges}")
        time.sleep(0.3)
