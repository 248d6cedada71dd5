"""`bench_compare` reads tandem-bench results and plots a stage's CDF (CPU, synthetic results)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from tandem.bench import compare as bench_compare
from tandem.bench import util as benchutil


def _result(values: list[float | None]) -> dict:
    records = [
        {"error": None, "ttfa_ms": 10.0 + i, "waterfall_ms": {} if v is None else {"d_entry->d_admit": v}}
        for i, v in enumerate(values)
    ]
    records.append({"error": "[UNAVAILABLE] no capacity", "ttfa_ms": float("nan"), "waterfall_ms": {}})
    return {"models": {"tts": {"levels": [{"records": records}]}}}


def test_stage_values_skip_errors_and_missing_stages() -> None:
    r = _result([1.0, None, 3.0])
    assert bench_compare.stage_values(r, "tts", "d_entry->d_admit") == [1.0, 3.0]
    assert bench_compare.stage_values(r, "tts", "ttfa") == [10.0, 11.0, 12.0]


def test_plots_two_results(tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "before.json", tmp_path / "after.json"
    a.write_text(json.dumps(_result([3.0, 5.0, 9.0])))
    b.write_text(json.dumps(_result([0.5, 0.8, 2.0])))
    out = tmp_path / "cmp.png"
    assert bench_compare.main([str(a), str(b), "--stage", "d_entry->d_admit", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "before: 3 streams, d_entry->d_admit p50 5.00 ms" in printed
    assert "after: 3 streams, d_entry->d_admit p50 0.80 ms" in printed


def test_a_stage_nobody_has_is_an_error(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_result([None])))
    assert bench_compare.main([str(a), "--stage", "d_entry->d_admit", "--out", str(tmp_path / "x.png")]) == 2


def test_a_result_is_read_plain_or_gzip_compressed(tmp_path) -> None:
    """docs/benchmarks keeps its large records as NAME.json.gz: readers take either form, and a
    NAME.json that is absent is read from NAME.json.gz."""
    plain = tmp_path / "r.json"
    benchutil.write_json(plain, {"meta": {"command": "x"}, "v": [1, 2]})
    packed = tmp_path / "r.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert (
        benchutil.read_json(plain) == benchutil.read_json(packed) == {"meta": {"command": "x"}, "v": [1, 2]}
    )
    plain.unlink()
    assert benchutil.read_json(plain)["v"] == [1, 2]
    assert benchutil.png_beside(packed) == benchutil.png_beside(plain) == tmp_path / "r.png"
