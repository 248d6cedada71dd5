"""D's rate-floor step model (`backend/scheduling/step_model.py`) and its start-up seed
(`backend/engines/decode/calibration.py`): what it admits, that a seeded model predicts before any
live step, and that timing the real loop at start leaves the pool, the batch and the metrics exactly
as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.backend.engines.decode import calibration
from tandem.backend.engines.parts import make_batch, make_pool
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.scheduling.step_model import MIN_SAMPLES, StepTimeModel
from tandem.backend.settings import BatchSettings, EngineSettings, PoolSettings


def _linear(b: int, ctx: int) -> float:
    return 0.004 + 1e-4 * b + 1e-7 * ctx


def test_step_model_admits_under_the_floor_only():
    m = StepTimeModel(refit_every=8)
    assert m.admits(100, 10**6, 1000, 42.0, 0.2)  # no data yet: admit and learn
    rng = np.random.default_rng(0)
    for _ in range(64):
        b = int(rng.integers(1, 64))
        ctx = b * int(rng.integers(100, 2000))
        m.observe(b, ctx, 0.004 + 1e-4 * b + 1e-7 * ctx)
    assert m.ready
    assert m.predict(10, 10_000) == pytest.approx(0.004 + 1e-3 + 1e-3, rel=0.05)
    budget = 0.8 / 42.0
    k = m.admittable(10, 10_000, 1000, 42.0, 0.2, limit=500)
    assert m.predict(10 + k, 10_000 + k * 1000) <= budget < m.predict(11 + k, 11_000 + k * 1000)


def test_step_model_never_locks_out_an_idle_engine():
    m = StepTimeModel(refit_every=8)
    for _ in range(32):  # a slow stretch (e.g. the process was paused): one stream took 100 ms a step
        m.observe(1, 500, 0.1)
    assert m.ready and m.predict(1, 500) > 0.8 / 42.0
    assert m.admits(0, 0, 500, 42.0, 0.2)  # idle: admit, so steps run and refresh the fit
    assert m.admittable(0, 0, 500, 42.0, 0.2, limit=64) == 1
    assert not m.admits(1, 500, 500, 42.0, 0.2)  # busy: the floor still protects running streams


def test_a_seeded_model_predicts_unseen_batches_before_any_live_step():
    """Seeded with spread (batch, context) steps, the model is ready at once and predicts a batch of
    64 that live steps never showed; a live window of small, slower steps lifts the intercept (p90
    of the live residuals) without losing the seeded slopes."""
    m = StepTimeModel(refit_every=8)
    seed = [(b, b * c, _linear(b, b * c)) for b in (1, 16, 32, 64) for c in (128, 1024) for _ in range(4)]
    m.seed(seed)
    assert m.ready
    assert m.predict(64, 64 * 2048) == pytest.approx(_linear(64, 64 * 2048), rel=0.02)
    for _ in range(MIN_SAMPLES * 2):  # live: only small batches, each 3 ms slower than the seed says
        m.observe(4, 4 * 500, _linear(4, 4 * 500) + 0.003)
    assert m.predict(4, 2000) >= _linear(4, 2000) + 0.003 * 0.9  # covers what live steps take
    slope = (m.predict(64, 64 * 1000) - m.predict(32, 32 * 1000)) / 32
    assert slope == pytest.approx((_linear(64, 64_000) - _linear(32, 32_000)) / 32, rel=0.25)
    assert not m.admits(63, 63 * 2048, 2048, 42.0, 0.2)  # 64 x 2k does not fit a 19 ms budget here


def test_too_small_a_seed_waits_for_live_steps():
    m = StepTimeModel()
    m.seed([(1, 10, 0.01)] * (MIN_SAMPLES - 1))
    assert not m.ready
    m.seed([(0, 10, 0.01), (4, 10, -1.0)] * MIN_SAMPLES)  # empty or negative steps are not samples
    assert not m.ready


def test_points_cover_the_batch_range_within_the_pool():
    plan = calibration.points(64, 2048, 512 * 16, 4, 16)
    assert {p.batch for p in plan} == {1, 16, 32, 64}
    for p in plan:
        assert p.batch * (p.context + calibration.WARMUP_STEPS + 4 + 2 + 16) <= 512 * 16
    assert calibration.Point(1, 2048) in plan and calibration.Point(1, 256) in plan
    assert calibration.points(8, 2048, 16, 4, 16) == []  # nothing fits: D learns live


def test_calibration_times_the_real_loop_and_leaves_everything_as_it_was():
    dec = Decoder.random(preset("tiny"), "cpu", seed=0)
    s = EngineSettings(pool=PoolSettings(num_pages=256, page_size=16), batch=BatchSettings(max_batch=16))
    pool = make_pool(dec, s)
    metrics = RecordingMetrics()
    batch = make_batch(dec, pool, s, metrics)
    free = pool.num_free_pages
    plan = calibration.points(16, 512, free * 16, 3, 16)
    steps = calibration.time_steps(batch, plan, 3)
    assert len(steps) == 3 * len(plan)
    for i, pt in enumerate(plan):
        for k, f in enumerate(steps[3 * i : 3 * i + 3]):
            assert f.batch == pt.batch and f.seconds > 0
            # the k-th timed step follows WARMUP_STEPS untimed ones: every stream is that far along
            assert f.context == pt.batch * (pt.context + calibration.WARMUP_STEPS + k + 1)
    assert pool.num_free_pages == free and len(batch) == 0 and not batch.in_flight
    assert not torch.any(pool.kv)  # zeroed again
    assert not metrics.values and not metrics.samples and batch.device_busy_s == 0.0
    m = StepTimeModel()
    m.seed([(f.batch, f.context, f.seconds) for f in steps])
    assert m.ready and m.predict(16, 16 * 512) >= m.predict(1, 1) > 0  # slopes are never negative


def test_calibration_needs_an_empty_batch():
    dec = Decoder.random(preset("tiny"), "cpu", seed=0)
    s = EngineSettings(pool=PoolSettings(num_pages=64, page_size=16))
    pool = make_pool(dec, s)
    batch = make_batch(dec, pool, s, RecordingMetrics())
    from tests.support.engines import Job

    Job(dec, pool, 0, 5).add_to(batch)
    with pytest.raises(RuntimeError, match="empty batch"):
        calibration.time_steps(batch, [calibration.Point(1, 8)], 2)
    assert np.isfinite(pool.kv.sum().item())
