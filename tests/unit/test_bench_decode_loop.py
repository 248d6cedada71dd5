"""`tandem-bench-decode-loop` on the CPU (tiny preset, a few steps): it runs both loops and the
start-up calibration, and its figures are consistent with each other (not their size)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tandem.bench import decode_loop as bench_decode_loop

SMALL = ["--preset", "tiny", "--device", "cpu", "--batches", "1,4", "--context", "24", "--steps", "8"]
SMALL += ["--warmup", "1", "--host-ms", "0,1", "--calibrate", "--calibrate-steps", "3", "--probes", "2"]


def test_cpu_run_writes_consistent_figures(tmp_path, capsys) -> None:
    assert bench_decode_loop.main([*SMALL, "--out", str(tmp_path), "--name", "r"]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    runs = result["runs"]
    assert {(r["mode"], r["batch"], r["host_ms"]) for r in runs} == {
        (m, b, h) for m in ("serial", "pipelined") for b in (1, 4) for h in (0.0, 1.0)
    }
    for r in runs:
        assert r["steps"] == 8 == len(r["period_samples_ms"]) == len(r["device_samples_ms"])
        # both probes joined and got their first chunk, after they were ready (not before)
        assert len(r["join_ms_samples"]) == 2 and all(x > 0 for x in r["join_ms_samples"])
        assert r["busy"] == pytest.approx(sum(r["device_samples_ms"]) / sum(r["period_samples_ms"]))
        assert 0 < r["busy"] <= 1.5  # CPU timers: device time is the forward's own wall time
        assert r["tok_s_per_stream"] == pytest.approx(1e3 / r["period_median_ms"])
        if r["host_ms"] == 1.0:  # the host's spin is in every period it follows
            assert min(r["period_samples_ms"]) >= 1.0
        # every timed step attends over at least the main streams' prompts and rows so far
        ctxs = r["step_contexts"]
        assert all(c >= r["batch"] * (r["context"] + 2 + k) for k, c in enumerate(ctxs))
        assert r["predicted_ms"] > 0
    cal = result["calibration"]
    assert len(cal["samples"]) == 3 * len(cal["plan"]) and len(cal["coef_ms"]) == 3
    printed = capsys.readouterr()
    assert "start-up calibration" in printed.out
    png = tmp_path / "r.png"
    if importlib.util.find_spec("matplotlib") is None:  # the JSON is still written; the run says so
        assert not png.exists() and "no PNG written" in printed.err
    else:  # matplotlib is a dev dependency: the figure is drawn
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_bad_arguments_are_refused(tmp_path) -> None:
    with pytest.raises(SystemExit):
        bench_decode_loop.main(["--modes", "fast", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bench_decode_loop.main(["--steps", "1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):  # more probes than timed turns to start them on
        bench_decode_loop.main(["--steps", "6", "--probes", "4", "--out", str(tmp_path)])
