"""1P2D on the CPU: one `prefill` instance feeding two `decode` instances (separate processes, each
with its own pool and receive arena). Triton's sequence batcher keeps each stream on one D."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.gateway.client import run_concurrent
from tests.support.helpers import metric_value, metrics_text, prompt, wait_metric
from tests.support.server import TritonProcess


@pytest.fixture(scope="module")
def unit_1p2d(tmp_path_factory: pytest.TempPathFactory):
    proc = TritonProcess(
        tmp_path_factory.mktemp("1p2d"), groups={"decode": "{ kind: KIND_CPU count: 2 }"}
    ).start()
    yield proc
    proc.stop()


def test_one_prefill_feeds_two_decoders_with_identical_tokens(unit_1p2d):
    jobs = [
        (prompt(10 + 7 * i, seed=i), {"MAX_TOKENS": 12, "TEMPERATURE": 0.0 if i % 2 else 0.8, "SEED": i})
        for i in range(24)
    ]
    pd = run_concurrent(unit_1p2d.url, "tts", jobs)
    mono = run_concurrent(unit_1p2d.url, "tts_mono", jobs)
    for a, b in zip(pd, mono, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        np.testing.assert_array_equal(a.rows, b.rows)
    wait_metric(
        unit_1p2d.metrics_url,
        "tandem_kv_verifications_total",
        lambda v: v == len(jobs),
        model="decode",
        result="ok",
    )
    text = metrics_text(unit_1p2d.metrics_url)
    served = [
        metric_value(text, "tandem_streams_total", model="decode", model_instance=name, outcome="finished")
        for name in ("decode_0_0", "decode_0_1")
    ]
    assert sum(served) == len(jobs)
    assert all(n > 0 for n in served), served  # both D processes decoded streams
    assert metric_value(text, "tandem_kv_verifications_total", model="decode", result="ok") == len(jobs)
