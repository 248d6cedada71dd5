"""The metrics every engine publishes, by name, and the sink they are published through.

Engines call a `MetricsSink` with a declared name; the Triton adapter implements it with
`pb_utils.MetricFamily` (so the figures appear on Triton's own `/metrics` endpoint), tests with
`RecordingMetrics`. Names are declared once here so the adapter can create every family at start-up.

Prometheus' conventions hold for every name: durations in seconds and sizes in bytes (name and
value), counters end in `_total`, info gauges in `_info`, and no label is called `instance` (the sink's
constant labels are `model` and `model_instance`). A counter that an alert reads must exist before its
first increment, or the alert sees no data instead of 0: `zero_labels` lists the label sets the sink
of each engine in `zero_in` creates at 0 when it starts (`zero_series`), so call sites only count.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Kind(IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


class Engine(IntEnum):
    """The engines that publish metrics, one sink each (their model adapters)."""

    PREFILL = 0
    DECODE = 1
    MONO = 2


Labels = tuple[tuple[str, str], ...]
UNLABELLED: tuple[Labels, ...] = ((),)


def each(label: str, *values: str) -> tuple[Labels, ...]:
    """One label set per value of `label`, for `zero_labels`."""
    return tuple(((label, v),) for v in values)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: Kind
    description: str
    buckets: tuple[float, ...] = ()
    zero_labels: tuple[Labels, ...] = ()  # label sets exported at 0 from start-up...
    zero_in: frozenset[Engine] = frozenset()  # ...by the sinks of these engines


_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_BYTES = (2**16, 2**20, 2**22, 2**24, 2**26, 2**28, 2**30)
_PROMPTS = (1, 2, 4, 8, 16, 32, 64)
_FIRST_AUDIO = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_D = frozenset({Engine.DECODE})
_STREAMS = frozenset({Engine.DECODE, Engine.MONO})
_CACHE = frozenset({Engine.PREFILL, Engine.MONO})

# The proofs that free a failed transfer's receive region (docs/failure-semantics.md); the `proof`
# label of tandem_kv_regions_released_total takes exactly these values.
RELEASE_PROOFS = ("abort_ack", "done", "refused", "instance_changed", "instance_gone", "receiver_drops")
STREAM_OUTCOMES = ("finished", "failed", "cancelled")

METRICS: tuple[MetricDef, ...] = (
    MetricDef("tandem_inflight_streams", Kind.GAUGE, "Streams admitted and not yet finished"),
    MetricDef("tandem_admittable_streams", Kind.GAUGE, "More streams the engine can admit now"),
    MetricDef("tandem_queued_requests", Kind.GAUGE, "Requests waiting for admission"),
    MetricDef("tandem_free_pages", Kind.GAUGE, "Free KV pages in the engine's pool"),
    MetricDef("tandem_held_pages", Kind.GAUGE, "KV pages quarantined after a failed transfer"),
    MetricDef("tandem_draining", Kind.GAUGE, "1 while decode admits nothing new (held pages over limit)"),
    MetricDef("tandem_transfer_path_info", Kind.GAUGE, "Chosen KV transfer path (info gauge, label path)"),
    MetricDef("tandem_transfer_bytes", Kind.HISTOGRAM, "Bytes per KV transfer", _BYTES),
    MetricDef(
        "tandem_transfer_latency_seconds", Kind.HISTOGRAM, "KV transfer time, request to verified", _SECONDS
    ),
    MetricDef(
        "tandem_transfers_total",
        Kind.COUNTER,
        "KV transfers by outcome (label outcome)",
        zero_labels=each("outcome", "ok", "failed"),
        zero_in=_D,
    ),
    MetricDef(
        "tandem_kv_verifications_total",
        Kind.COUNTER,
        "KV checksum verifications (label result)",
        zero_labels=each("result", "ok", "mismatch"),
        zero_in=_D,
    ),
    MetricDef(
        "tandem_kv_regions_released_total",
        Kind.COUNTER,
        "Receive regions of failed transfers freed, by the proof that freed them (label proof)",
        zero_labels=each("proof", *RELEASE_PROOFS),
        zero_in=_D,
    ),
    MetricDef(
        "tandem_kv_late_chunks_dropped_total",
        Kind.COUNTER,
        "KV chunks D dropped because their transfer had already failed (paths where D writes: tcp)",
        zero_labels=UNLABELLED,
        zero_in=_D,
    ),
    MetricDef(
        "tandem_streams_below_floor_total",
        Kind.COUNTER,
        "Streams that finished below the rate floor",
        zero_labels=UNLABELLED,
        zero_in=_STREAMS,
    ),
    MetricDef(
        "tandem_streams_total",
        Kind.COUNTER,
        "Streams by outcome (label outcome)",
        zero_labels=each("outcome", *STREAM_OUTCOMES),
        zero_in=_STREAMS,
    ),
    MetricDef("tandem_step_seconds", Kind.HISTOGRAM, "Decode step time", _SECONDS),
    MetricDef(
        "tandem_decode_eager",
        Kind.GAUGE,
        "1 when a CUDA-graph capture failed and decode steps run eagerly (much slower; see the log)",
    ),
    MetricDef(
        "tandem_device_busy_seconds_total",
        Kind.COUNTER,
        "Time the device spent running decode steps (CUDA: event span of each step; CPU: the step's compute)",
        zero_labels=UNLABELLED,
        zero_in=_D,
    ),
    MetricDef("tandem_prefill_seconds", Kind.HISTOGRAM, "Prefill forward time", _SECONDS),
    MetricDef("tandem_prefill_batch", Kind.HISTOGRAM, "Prompts per prefill forward", _PROMPTS),
    MetricDef("tandem_admission_seconds", Kind.HISTOGRAM, "Time from engine receipt to admission", _SECONDS),
    MetricDef(
        "tandem_first_audio_seconds",
        Kind.HISTOGRAM,
        "A stream's time to first audio on the unit: the prompt's entry (prefill's execute in tts, after"
        " the text front end; tts_mono's own) to its first sounding chunk's audio (published by the"
        " vocoder for tts, by tts_mono)",
        _FIRST_AUDIO,
    ),
    MetricDef(
        "tandem_prefix_cache_hit_tokens_total",
        Kind.COUNTER,
        "Prompt tokens served by the prefix cache",
        zero_labels=UNLABELLED,
        zero_in=_CACHE,
    ),
    # Published by the stub, not the engine (serving/engine_worker.py), labelled model, model_instance.
    MetricDef(
        "tandem_engine_up",
        Kind.GAUGE,
        "1 while the model instance's engine worker answers; 0 while it is stalled, dead or restarting",
    ),
    MetricDef(
        "tandem_engine_restarts_total", Kind.COUNTER, "Engine worker processes started again after a death"
    ),
    # Published by every stub about itself (serving/stub_guard.py), labelled model, model_instance.
    MetricDef(
        "tandem_stub_heartbeat_timestamp_seconds",
        Kind.GAUGE,
        "Unix time of the stub's last heartbeat (every second); stale when the stub is dead or stopped",
    ),
    MetricDef(
        "tandem_model_reloads",
        Kind.GAUGE,
        "Times tandem-unit reloaded this model after its stub died, since the unit started",
    ),
)

# The metrics a stub publishes about its worker (labels model, model_instance; no engine records them).
WORKER_METRICS = ("tandem_engine_up", "tandem_engine_restarts_total")
# The metrics every stub publishes about itself (serving/stub_guard.py).
STUB_METRICS = ("tandem_stub_heartbeat_timestamp_seconds", "tandem_model_reloads")

BY_NAME = {m.name: m for m in METRICS}


def zero_series(engine: Engine) -> list[tuple[str, dict[str, str]]]:
    """(name, labels) of every series `engine`'s sink exports at 0 from start-up."""
    return [(m.name, dict(labels)) for m in METRICS if engine in m.zero_in for labels in m.zero_labels]


class MetricsSink(Protocol):
    def set(self, name: str, value: float, **labels: str) -> None: ...

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None: ...

    def observe(self, name: str, value: float, **labels: str) -> None: ...


def _key(name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    if name not in BY_NAME:
        raise KeyError(f"undeclared metric {name}")
    return name, tuple(sorted(labels.items()))


class RecordingMetrics:
    """In-memory sink for tests and for engines run outside Triton."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self.samples: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)

    def set(self, name: str, value: float, **labels: str) -> None:
        self.values[_key(name, labels)] = value

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        self.values[_key(name, labels)] += by

    def observe(self, name: str, value: float, **labels: str) -> None:
        self.samples[_key(name, labels)].append(value)

    def get(self, name: str, **labels: str) -> float:
        return self.values.get(_key(name, labels), 0.0)


class PublishTimer:
    """Limits how often an engine loop publishes its gauges.

    Each gauge update through Triton's python backend is a round trip to the server process; done on
    every decode step it costs the loop milliseconds per iteration. Gauges are read by scrapers every
    few seconds, so publishing every `interval_s` loses nothing. Counters and histograms are still
    recorded as events happen.
    """

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return True
