"""perf_analyzer's input data is valid for the checked-in repository, and the first-audio reading of
its profile export takes the first response of each request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tandem.backend.model.config import preset
from tandem.backend.prompt import check_prompt, parse_params
from tandem.backend.settings import Limits
from tandem.bench.perf_data import first_response_latencies, input_data

ROOT = Path(__file__).resolve().parents[2]


def _steps(data: dict) -> list[dict]:
    assert all(isinstance(seq, list) and len(seq) == 1 for seq in data["data"])  # one step per stream
    return [seq[0] for seq in data["data"]]


def test_checked_in_inputs_pass_the_servers_validation():
    cfg, limits = preset("tiny"), Limits()
    data = json.loads((ROOT / "docs" / "perf_analyzer" / "tiny-w4-v1024.json").read_text())
    steps = _steps(data)
    assert len(steps) == 16
    for step in steps:
        p = np.array(step["PROMPT"]["content"], dtype=np.int64).reshape(step["PROMPT"]["shape"])
        assert p.shape[1] == cfg.row_width
        check_prompt(p, cfg, limits)
        parse_params(
            {
                "MAX_TOKENS": np.array(step["MAX_TOKENS"]["content"], np.int32),
                "TEMPERATURE": np.array(step["TEMPERATURE"]["content"], np.float32),
            },
            cfg,
            limits,
        )


def test_input_data_is_reproducible_and_in_range():
    a, b = input_data(3, 5, 4, 1024, 8, seed=1), input_data(3, 5, 4, 1024, 8, seed=1)
    assert a == b
    for step in _steps(a):
        assert step["PROMPT"]["shape"] == [5, 4] and len(step["PROMPT"]["content"]) == 20
        assert min(step["PROMPT"]["content"]) >= 0 and max(step["PROMPT"]["content"]) < 1024


def test_first_response_is_read_from_the_first_timestamp():
    ms = 1_000_000
    profile = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 1},
                "requests": [
                    {"timestamp": 0, "response_timestamps": [10 * ms, 20 * ms, 90 * ms]},
                    {"timestamp": 100 * ms, "response_timestamps": [130 * ms, 200 * ms]},
                    {"timestamp": 300 * ms, "response_timestamps": []},  # no response: not counted
                ],
            }
        ]
    }
    (row,) = first_response_latencies(profile)
    assert row["requests"] == 2 and row["mode"] == "concurrency" and row["value"] == 1
    assert row["first_response_p50_ms"] == 20.0 and row["last_response_p50_ms"] == 95.0
