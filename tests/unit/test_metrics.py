"""The metric declarations follow Prometheus' conventions, every name a call site uses is declared, and the
Triton sink creates the series alerts read at 0 when it starts (through a stand-in for pb_utils)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tandem.backend.metrics import (
    BY_NAME,
    METRICS,
    RELEASE_PROOFS,
    Engine,
    Kind,
    RecordingMetrics,
    zero_series,
)
from tandem.serving.triton_io import TritonMetrics

ROOT = Path(__file__).resolve().parents[2]
CALL = re.compile(r"\.(set|inc|observe)\(\s*\"(tandem_\w+)\"((?:[^()]|\([^()]*\))*)\)", re.S)


class _Metric:
    def __init__(self, family: _Family, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.family, self.labels, self.buckets, self.value = family, labels, buckets, 0.0

    def increment(self, by: float) -> None:
        self.value += by

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.value += value


class _Family:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: ClassVar[list[_Family]] = []

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.kind, self.metrics = name, kind, []
        _Family.created.append(self)

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _Metric:
        m = _Metric(self, dict(labels), buckets)
        self.metrics.append(m)
        return m


class _Pb:
    MetricFamily = _Family


def _series(families: list[_Family]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(f.name, tuple(sorted(m.labels.items()))): m.value for f in families for m in f.metrics}


def _call_sites() -> list[tuple[str, str, str]]:
    """(file, name, arguments) of every sink call with a literal metric name under backend/."""
    out = []
    for path in sorted((ROOT / "backend").rglob("*.py")):
        for m in CALL.finditer(path.read_text()):
            out.append((str(path.relative_to(ROOT)), m.group(2), m.group(3)))
    return out


def test_names_follow_prometheus_conventions() -> None:
    for m in METRICS:
        assert m.name.startswith("tandem_"), m.name
        assert not re.search(r"_(ms|us|ns|kb|mb|kib|mib)(_|$)", m.name), f"{m.name}: not in base units"
        assert (m.kind == Kind.COUNTER) == m.name.endswith("_total"), (
            f"{m.name}: counters and only counters end _total"
        )
        if m.kind == Kind.HISTOGRAM:
            assert list(m.buckets) == sorted(m.buckets) and m.buckets, m.name
        if m.name.endswith("_seconds") and m.kind == Kind.HISTOGRAM:
            assert max(m.buckets) <= 60, f"{m.name}: buckets look like milliseconds"
    assert "tandem_transfer_path_info" in BY_NAME and "tandem_transfer_path" not in BY_NAME


def test_every_call_site_names_a_declared_metric_without_an_instance_label() -> None:
    sites = _call_sites()
    assert len(sites) > 20  # the regex still finds the call sites
    for file, name, args in sites:
        assert name in BY_NAME, f"{file}: {name} is not declared in backend/metrics.py"
        assert not re.search(r"\binstance\s*=", args), f"{file}: {name} uses the label `instance`"


def test_zero_series_are_counters_with_the_labels_their_call_sites_use() -> None:
    used = {(name, tuple(sorted(re.findall(r"(\w+)\s*=", args)))) for _, name, args in _call_sites()}
    for engine in Engine:
        for name, labels in zero_series(engine):
            assert BY_NAME[name].kind == Kind.COUNTER, name
            assert (name, tuple(sorted(labels))) in used, (
                f"{name}{labels}: no call site uses these label names"
            )


def test_release_proofs_are_the_ones_decode_counts() -> None:
    from tandem.backend.engines.decode.metrics import _PROOFS

    assert set(RELEASE_PROOFS) == set(_PROOFS.values())


@pytest.mark.parametrize("engine", list(Engine))
def test_triton_sink_creates_the_alerted_series_at_zero(engine: Engine) -> None:
    _Family.created = []
    const = {"model": "decode", "model_instance": "decode_0_0"}
    TritonMetrics(_Pb(), const, engine=engine)
    series = _series(_Family.created)
    expected = {(n, tuple(sorted({**const, **labels}.items()))) for n, labels in zero_series(engine)}
    assert set(series) == expected
    assert all(v == 0 for v in series.values())
    assert {f.name for f in _Family.created} == set(BY_NAME)  # every family exists, used or not


def test_decode_zero_series_cover_what_alerts_read() -> None:
    names = {(n, tuple(labels.items())) for n, labels in zero_series(Engine.DECODE)}
    assert ("tandem_streams_below_floor_total", ()) in names
    assert ("tandem_kv_late_chunks_dropped_total", ()) in names
    assert ("tandem_streams_total", (("outcome", "failed"),)) in names
    assert {p for n, labels in names if n == "tandem_kv_regions_released_total" for _, p in labels} == set(
        RELEASE_PROOFS
    )


def test_triton_sink_merges_const_labels_and_reuses_series() -> None:
    _Family.created = []
    sink: Any = TritonMetrics(
        _Pb(), {"model": "decode", "model_instance": "decode_0_0"}, engine=Engine.DECODE
    )
    sink.inc("tandem_streams_total", outcome="failed")
    sink.inc("tandem_streams_total", 2, outcome="failed")
    sink.observe("tandem_step_seconds", 0.012)
    series = _series(_Family.created)
    key = (
        "tandem_streams_total",
        (("model", "decode"), ("model_instance", "decode_0_0"), ("outcome", "failed")),
    )
    assert series[key] == 3
    step = next(f for f in _Family.created if f.name == "tandem_step_seconds").metrics[0]
    assert step.buckets == list(BY_NAME["tandem_step_seconds"].buckets)


def test_recording_sink_refuses_undeclared_names() -> None:
    with pytest.raises(KeyError, match="undeclared"):
        RecordingMetrics().inc("tandem_step_ms")
