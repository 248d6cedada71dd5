"""Docs that match the code: every metric the engines define and every waterfall stage is explained in
docs/operations.md, and every `tandem.<section>.<name>` setting the guide names is one the engines accept."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tandem.backend.metrics import METRICS
from tandem.backend.settings import EngineSettings
from tandem.backend.timing import STAGES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


def test_every_metric_is_documented() -> None:
    missing = [m.name for m in METRICS if m.name not in DOC]
    assert not missing, f"metrics missing from docs/operations.md: {missing}"


def test_documented_settings_exist() -> None:
    base = EngineSettings()
    named = set(re.findall(r"`(tandem\.[a-z_]+\.[a-z_]+)`", DOC))
    unknown = []
    for name in sorted(named):
        _, section, field = name.split(".")
        group = getattr(base, section, None)
        if not dataclasses.is_dataclass(group) or field not in {f.name for f in dataclasses.fields(group)}:
            unknown.append(name)
    assert named and not unknown, f"docs/operations.md names settings the code does not accept: {unknown}"


def test_every_waterfall_stage_is_documented() -> None:
    missing = [s for s in STAGES if f"`{s}`" not in DOC]
    assert not missing, f"waterfall stages missing from docs/operations.md: {missing}"
