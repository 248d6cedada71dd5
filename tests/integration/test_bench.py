"""`tandem-bench --smoke` end to end on the CPU: figures are produced and consistent (not their size)."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.capacity import capacities, main, parse_levels, stalls
from tandem.gateway.client import StreamResult


def test_bench_smoke_produces_consistent_figures(server, tmp_path):
    args = ["--url", server.url, "--metrics-url", server.metrics_url, "--smoke", "--out", str(tmp_path)]
    assert main(args) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert result["commit"] and result["floor_tok_s"] == 42.0
    assert set(result["models"]) == {"tts", "tts_mono"}
    for model in result["models"].values():
        levels = model["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            assert lv["streams"] == len(lv["records"]) == 4
            assert lv["streams_stalled"] <= lv["streams"] and lv["stalls"] >= lv["streams_stalled"]
            assert lv["silent_lead_responses"] == lv["streams_silent_lead"] == 0  # every first chunk sounds
            for r in lv["records"]:
                assert r["error"] is None and r["rows"] > 0
                assert r["ttfa_ms"] > 0
                assert math.isnan(r["rate_tok_s"]) or r["rate_tok_s"] > 0
                # the waterfall runs from the client's send to its first audio through the unit's
                # stages, each stamped by its own process, in causal order
                chain = [s.split("->") for s in r["waterfall_ms"]]
                assert chain[0][0] == "client_send" and chain[-1][1] == "client_first_audio", chain
                assert {"entry", "first_audio"} <= {s for pair in chain for s in pair}, chain
                assert all(ms >= 0 for ms in r["waterfall_ms"].values()), r["waterfall_ms"]
            if model is result["models"]["tts"]:  # D's admission latency and device busy fraction
                assert 0 < lv["d_admit_ms"]["p50"] <= lv["d_admit_ms"]["p99"]
                assert lv["decode_device_busy"] is not None and 0 < lv["decode_device_busy"] <= 1.0
            else:
                assert lv["d_admit_ms"] == {} and lv["decode_device_busy"] is None
        # whether a level passes here depends on the box's load; test_per_model_levels_ramp_and_a_floor_
        # no_stream_keeps fixes the outcome in advance, test_capacity_with_a_start_bound the rule
        assert model["capacity"] in (0, 1, 2) and model["capacity_start_bounded"] <= model["capacity"]
        for lv in levels:  # each client's first request, and TTFA over the rest (onto a running load)
            assert sum(r["first_of_client"] for r in lv["records"]) == lv["concurrency"]
            assert lv["ramp_s"] == 0.0 and lv["ttfa_ms_later"]["p50"] > 0


def test_bench_per_model_levels_ramp_and_a_floor_no_stream_keeps(server, tmp_path, capsys):
    """Per-model levels run only those levels; a ramp starts the clients spread out. With a floor of
    1e9 tok/s, which no stream reaches, every stream with a rate is below it, so no level passes and
    the capacity is 0, whatever the load: the outcome is known before the run."""
    args = ["--url", server.url, "--metrics-url", server.metrics_url, "--smoke", "--out", str(tmp_path)]
    args += ["--models", "tts_mono", "--ramp-s", "0.3", "--floor", "1e9"]
    assert main(args) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result["models"]) == {"tts_mono"} and result["floor_tok_s"] == 1e9
    model = result["models"]["tts_mono"]
    for lv in model["levels"]:
        assert lv["ramp_s"] == 0.3 and lv["errors"] == 0
        rated = [r for r in lv["records"] if math.isfinite(r["rate_tok_s"])]
        assert rated and all(r["below_floor"] for r in rated)
        assert lv["streams_below_floor"] == len(rated) and lv["passed"] is False
    assert model["capacity"] == 0 and model["capacity_start_bounded"] == 0
    assert "tts_mono: capacity 0 streams" in capsys.readouterr().out


def test_capacity_with_a_start_bound():
    def lv(c: int, passed: bool, p95: float) -> dict:
        return {"concurrency": c, "passed": passed, "ttfa_ms": {"p95": p95}}

    levels = [lv(8, True, 200), lv(16, True, 900), lv(32, True, 2500), lv(48, False, 300)]
    assert capacities(levels, 1000.0) == (32, 16)  # 32 passes the stall rule but starts too late
    assert capacities(levels, 100.0) == (32, 0)
    assert capacities([lv(8, False, 10)], 1000.0) == (0, 0)


def test_parse_levels_forms_and_bad_input():
    assert parse_levels("1,2,4", ["a", "b"]) == {"a": [1, 2, 4], "b": [1, 2, 4]}
    assert parse_levels("a=8,16/b=4", ["a", "b"]) == {"a": [8, 16], "b": [4]}
    assert parse_levels("a=8", ["a", "b"]) == {"a": [8], "b": []}  # b gets no levels
    with pytest.raises(SystemExit, match="not in --models"):
        parse_levels("c=1", ["a", "b"])  # a model that is not benchmarked
    with pytest.raises(SystemExit, match="expected"):
        parse_levels("a=x", ["a"])  # not an int


def test_stall_accounting():
    r = StreamResult(stream_id=1)
    # 21 rows/s playback: 4 rows last 190 ms; the next response 100 ms later is in time, the one after
    # arrives 1 s after that, when the 8 + 4 rows (571 ms) have run out: one stall of ~0.53 s.
    r.response_ns = [0, 100_000_000, 1_100_000_000]
    r.response_rows = [4, 8, 8]
    n, stalled = stalls(r, 21.0)
    assert n == 1
    assert abs(stalled - (1.1 - (4 + 8) / 21.0)) < 1e-9
