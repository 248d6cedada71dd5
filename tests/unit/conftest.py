from __future__ import annotations

import pytest

from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder


@pytest.fixture(scope="module")
def decoder() -> Decoder:
    """The tiny preset with random weights on the CPU (seed 0): the engines' model in these tests."""
    return Decoder.random(preset("tiny"), "cpu", seed=0)
