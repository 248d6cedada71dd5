"""Rate-floor admission through the real server, made independent of this machine's speed.

D runs with a floor no step can meet (10^6 tok/s) and a 1 s admission wait. Once its step-time
model has seen enough steps, it predicts that any second stream would push the running one below the
floor: that stream waits, and after the bounded wait it gets UNAVAILABLE, while the running stream is
untouched and `tandem_admittable_streams` says 0. An idle D always admits one stream (its model can
only learn from steps it runs), so the next stream after that is served.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tandem.cli.tts_client import TTSClient
from tests.integration.helpers import TINY_W, prompt, run, wait_metric
from tests.integration.server import TritonProcess

OVERRIDES = {
    "decode": {
        "tandem.batch.rate_floor_tok_s": "1000000",
        "tandem.batch.admission_timeout_s": "1",
    }
}


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    proc = TritonProcess(tmp_path_factory.mktemp("admission"), OVERRIDES)
    shutil.rmtree(proc.repo / "tts_mono")  # not used here; saves a stub start
    proc.start()
    yield proc
    proc.stop()


def test_second_stream_waits_then_unavailable_and_the_first_keeps_going(unit):
    warm = run(unit.url, "tts", prompt(20), MAX_TOKENS=40, TEMPERATURE=0.0)  # 40 steps: the model fits
    assert warm.error is None
    with TTSClient(unit.url, "tts") as ca, TTSClient(unit.url, "tts") as cb:
        a = ca.send(prompt(30, seed=1), MAX_TOKENS=2000, TEMPERATURE=0.0)
        wait_metric(unit.metrics_url, "tandem_inflight_streams", lambda v: v >= 1, model="decode")
        wait_metric(unit.metrics_url, "tandem_admittable_streams", lambda v: v == 0, model="decode")
        b = cb.send(prompt(30, seed=2), MAX_TOKENS=10, TEMPERATURE=0.0)
        (rb,) = cb.wait([b], timeout_s=30)
        assert rb.error is not None and "[UNAVAILABLE]" in rb.error, rb.error
        assert "no capacity within the admission wait of 1 s" in rb.error, rb.error
        (ra,) = ca.wait([a], timeout_s=120)
    assert ra.error is None and ra.rows is not None and ra.rows.shape == (2000, TINY_W)
    assert ra.done_ns > rb.done_ns  # B was refused while A was still streaming
    after = run(unit.url, "tts", prompt(20, seed=3), MAX_TOKENS=5, TEMPERATURE=0.0)
    assert after.error is None and after.rows.shape == (5, TINY_W)  # an idle D admits again
    # The engine's counters reach /metrics with its worker's next heartbeat (tandem.worker.beat_s).
    wait_metric(
        unit.metrics_url, "tandem_streams_total", lambda v: v == 3, 5, model="decode", outcome="finished"
    )
