"""docs/security.md against the code: the locked APIs, header and settings it names are the ones
serving/api_key.py uses, and every test it cites exists."""

from __future__ import annotations

import re
from pathlib import Path

from tandem.serving.api_key import FILE_ENV, GRPC_HEADER, HEADER, LOCK_ENV, LOCKED_APIS

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "security.md").read_text()


def test_the_locked_apis_header_and_settings_are_the_codes() -> None:
    rule = f"{','.join(LOCKED_APIS)}:{HEADER}=<key>"
    assert f"--http-restricted-api={rule}" in DOC and f"--grpc-restricted-protocol={rule}" in DOC
    for name in (HEADER, GRPC_HEADER, FILE_ENV, f"{LOCK_ENV}=off"):
        assert f"`{name}" in DOC, name


def test_every_cited_test_exists() -> None:
    """`tests/x.py::test_a`, `::test_b` (the latter in the same file) name real test functions."""
    cited: list[tuple[str, str]] = []
    for cell in re.findall(r"`(tests/[\w/]+\.py)(::\w+)?`((?:, `::\w+`)*)", DOC):
        path, first, rest = cell
        names = [first[2:]] if first else []
        names += re.findall(r"`::(\w+)`", rest)
        cited += [(path, n) for n in names]
        assert (ROOT / path).is_file(), path
    missing = [f"{p}::{n}" for p, n in cited if not re.search(rf"^def {n}\(", (ROOT / p).read_text(), re.M)]
    assert len(cited) > 15 and not missing, missing
