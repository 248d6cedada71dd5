"""D's capacity bounds from its device (`engines/parts.size_from_device`) and their settings: the
batch bound follows the pool up to 512, a GPU-only pool share is refused elsewhere with the reason,
and out-of-range values name their parameter. (The GPU share itself is exercised on the H200 run.)"""

from __future__ import annotations

import pytest
import torch

from tandem.backend.engines.parts import build_decoder, size_from_device
from tandem.backend.settings import MAX_BATCH, parse_settings


def _settings(**params: str):
    return parse_settings({"model.preset": "tiny", "device": "cpu", **params})


def test_max_batch_zero_follows_the_pool_up_to_512() -> None:
    s = _settings(**{"batch.max_batch": "0", "pool.num_pages": "100"})
    decoder = build_decoder(s, torch.device("cpu"))
    assert size_from_device(s, decoder).batch.max_batch == 100
    big = _settings(**{"batch.max_batch": "0", "pool.num_pages": "4096"})
    sized = size_from_device(big, decoder)
    assert sized.batch.max_batch == MAX_BATCH == 512 and sized.pool.num_pages == 4096
    fixed = _settings(**{"batch.max_batch": "64"})
    assert size_from_device(fixed, decoder) == fixed  # explicit figures stay as they are


def test_a_pool_share_of_device_memory_is_refused_on_a_cpu() -> None:
    s = _settings(**{"pool.memory_fraction": "0.5"})
    with pytest.raises(ValueError, match=r"pool\.memory_fraction.*runs on cpu"):
        size_from_device(s, build_decoder(s, torch.device("cpu")))


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("batch.max_batch", "513", r"batch\.max_batch.*\[0, 512\]"),
        ("batch.max_batch", "-1", r"batch\.max_batch"),
        ("pool.memory_fraction", "1.0", r"pool\.memory_fraction.*\[0, 1\)"),
        ("pool.memory_fraction", "-0.1", r"pool\.memory_fraction"),
    ],
)
def test_out_of_range_capacity_settings_name_the_parameter(key: str, value: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _settings(**{key: value})
