"""`python -m tandem.bench.sampler` on the CPU (an Orpheus-layout decoder of test size, a few steps):
both paths run, draw the same tokens, and the fit and the head's bytes follow from what it measured."""

from __future__ import annotations

import pytest

from tandem.backend.model.decoder import Decoder
from tandem.bench import sampler as bench_sampler
from tests.support.text_models import orpheus_config


def test_both_paths_draw_the_same_tokens_and_fit_their_steps(capsys: pytest.CaptureFixture[str]) -> None:
    dec = Decoder.random(orpheus_config(), "cpu", seed=0)
    runs = [bench_sampler.measure(dec, b, steps=3, warmup=1, seed=0) for b in (1, 5)]
    for r in runs:
        assert r["tokens_equal"] is True
        for path in bench_sampler.PATHS:
            assert r[path]["step"]["n"] == 3 and r[path]["step"]["median_ms"] > 0
    fit = bench_sampler.fit(runs, "legal")
    b_ms = (runs[1]["legal"]["step"]["median_ms"] - runs[0]["legal"]["step"]["median_ms"]) / 4
    assert fit["b_us"] == pytest.approx(b_ms * 1e3)  # two points: the line through them
    hb = bench_sampler.head_bytes(dec)
    assert hb == {"whole": 156940 * 64 * 4, "legal": 28680 * 64 * 4}  # float32 rows of hidden 64
    params, positions = bench_sampler.streams(14)
    slots = {(pos - p.grammar_start) % 7 for p, pos in zip(params, positions, strict=True)}
    assert slots == set(range(7))  # the streams sit at every slot
