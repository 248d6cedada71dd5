"""The example alerts and the dashboard read only metrics that exist: every `tandem_*` name in
docs/prometheus-rules.yaml and docs/grafana-dashboard.json is declared by the engines
(backend/metrics.py) or the gateway (gateway/metrics.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tandem.backend.metrics import BY_NAME, Kind
from tandem.gateway.metrics import FIRST_AUDIO, NAMES

DOCS = Path(__file__).resolve().parents[2] / "docs"
HISTOGRAMS = {n for n, m in BY_NAME.items() if m.kind == Kind.HISTOGRAM} | {FIRST_AUDIO}


def _names(text: str) -> set[str]:
    out = set()
    for name in re.findall(r"\btandem_[a-z_]+", text):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        out.add(base if base in HISTOGRAMS else name)
    return out


def _exprs() -> dict[str, list[str]]:
    rules = yaml.safe_load((DOCS / "prometheus-rules.yaml").read_text())
    dash = json.loads((DOCS / "grafana-dashboard.json").read_text())
    return {
        "prometheus-rules.yaml": [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]],
        "grafana-dashboard.json": [t["expr"] for p in dash["panels"] for t in p["targets"]],
    }


def test_alerts_and_dashboard_name_only_declared_metrics():
    known = set(BY_NAME) | set(NAMES)
    for doc, exprs in _exprs().items():
        assert exprs, doc
        unknown = set().union(*(_names(e) for e in exprs)) - known
        assert not unknown, f"{doc} names metrics nobody publishes: {sorted(unknown)}"


def test_the_dashboard_covers_what_operators_watch():
    text = " ".join(_exprs()["grafana-dashboard.json"])
    for name in (
        "tandem_inflight_streams",
        "tandem_admittable_streams",
        "tandem_streams_below_floor_total",
        FIRST_AUDIO,
        "tandem_transfer_latency_seconds",
        "tandem_held_pages",
    ):
        assert name in text, name


def test_histograms_are_read_through_their_bucket_series():
    for exprs in _exprs().values():
        for e in exprs:
            for name in HISTOGRAMS:
                if "histogram_quantile" in e and name in e:
                    assert f"{name}_bucket" in e, e
