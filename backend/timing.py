"""Per-stage timestamps of one request, shared by every process on the machine.

All stamps are `time.time_ns()` (wall clock): P, D, the vocoder and the client run on one machine,
so their stamps line up and the stages of the waterfall add up to the client's own measurement.
The stamps travel as JSON: in the transfer ticket (P -> D) and in the `TIMINGS` output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from itertools import pairwise

# Canonical stage order of the waterfall; absent stamps are skipped.
STAGES = (
    "client_send",
    "entry",  # the first model of the request saw it (prefill / tts_mono execute)
    "admit",  # the engine loop took it
    "forward_start",
    "forward_end",
    "ticket",  # P handed the ticket back to Triton
    "d_entry",  # decode execute saw it
    "d_admit",  # D reserved pages and asked P for the KV
    "copy_start",  # P started gathering/copying
    "copy_end",  # P's copy into D's receive region is done (P's clock, carried in DONE)
    "d_done",  # D's transfer reader thread received P's DONE
    "d_checksummed",  # D's checksum of the received region matched P's (reader thread)
    "verified",  # D's engine thread picked the verified KV up and queued its scatter into the pages
    "first_chunk",  # the engine emitted the first rows
    "first_audio",  # the vocoder produced audio for them
    "client_first_audio",
    "last_chunk",
)


# Not a stamp: a count that rides with them, the request's prompt rows (set where the prompt is read,
# P or tts_mono), so the final `TIMINGS` tells the caller its input's size (the gateway's
# `usage.input_tokens`). `waterfall` reads only STAGES, so it is never taken for a time.
PROMPT_ROWS = "prompt_rows"

# The stages that add up to the client's time to first audio.
FIRST_AUDIO_STAGES = STAGES[: STAGES.index("client_first_audio") + 1]


def now_ns() -> int:
    return time.time_ns()


def first_audio_s(stamps: Mapping[str, int]) -> float | None:
    """The unit's time to first audio, `entry` -> `first_audio` in seconds (None until both exist):
    what `tandem_first_audio_seconds` observes once per stream."""
    entry, audio = stamps.get("entry"), stamps.get("first_audio")
    return None if entry is None or audio is None else max(0.0, (audio - entry) / 1e9)


class Timings:
    """An ordered set of named stamps. Not thread-safe: owned by one engine thread at a time."""

    __slots__ = ("_stamps",)

    def __init__(self, stamps: Mapping[str, int] | None = None) -> None:
        self._stamps: dict[str, int] = dict(stamps or {})

    def mark(self, stage: str, at: int | None = None) -> None:
        """Record `stage` once; a second mark of the same stage keeps the first."""
        self._stamps.setdefault(stage, now_ns() if at is None else at)

    def get(self, stage: str) -> int | None:
        return self._stamps.get(stage)

    def update(self, other: Mapping[str, int]) -> None:
        for k, v in other.items():
            self._stamps.setdefault(k, int(v))

    def as_dict(self) -> dict[str, int]:
        return dict(self._stamps)

    def to_json(self) -> str:
        return json.dumps(self._stamps, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Timings:
        if not text:
            return cls()
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("timings must be a JSON object")
        return cls({str(k): int(v) for k, v in data.items()})


def waterfall(stamps: Mapping[str, int], order: Iterable[str] = STAGES) -> list[tuple[str, float]]:
    """Consecutive stage durations in ms, in canonical order; they sum to last - first."""
    present = [(s, stamps[s]) for s in order if s in stamps]
    return [(f"{a}->{b}", (tb - ta) / 1e6) for (a, ta), (b, tb) in pairwise(present)]
