from __future__ import annotations

from pathlib import Path

import pytest

from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    """The tiny preset with random weights on the CPU (seed 0): the engines' model in these tests."""
    return Decoder.random(preset("tiny"), "cpu", seed=0)


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG_RUNTIME_DIR (the unit's directory lives there) and no API key from the caller's
    environment: what the supervisor and MPS tests start a unit in."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.delenv("TANDEM_API_KEY_FILE", raising=False)
    monkeypatch.delenv("TANDEM_API_LOCK", raising=False)
    return run
