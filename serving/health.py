"""The unit's health, read from Triton's metrics endpoint.

Triton's `/v2/health/ready` says the server and its stubs answer; it cannot see an engine worker that
stalled or died, nor a decode engine that drains (admits nothing new until quarantined pages come back).
The engines publish both on Triton's metrics endpoint:

- `tandem_engine_up{model, model_instance}`: 1 while the model instance's engine worker answers, 0 while
  it is stalled, dead or restarting;
- `tandem_draining{model, model_instance}`: 1 while a decode engine admits nothing new;
- `tandem_stub_heartbeat_timestamp_seconds{model, model_instance}`: the Unix time of every stub's
  last heartbeat (`serving/stub_guard.py`, each second). Triton keeps a dead stub's series at their
  last values (`tandem_engine_up` stays 1), so a heartbeat older than `STUB_SILENT_S` means the stub
  is dead or stopped: its model is not ready, and its engine counts as down.

Every stub publishes `tandem_engine_up` for itself from its first moment (0 until it serves;
`serving/stub_guard.py`): a model without an engine worker (frontend, vocoder) reads 1 while its stub
serves. A stub `tandem-unit` starts again after a death sets 0 over its dead predecessor's 1 at once.

Two failure domains: *speech* (every model but `voices`: `tts`, `tts_mono` and their steps) and
*voices* (registration, `VOICES_MODELS`). `ready`, `engines_up` and `reasons` judge speech alone, so a
voices engine that crashes or restarts never makes the unit unready for speech; `voices_ready` and
`voices_reasons` judge registration (the gateway's `/health` reports both, its status by speech).

Who reads this: `tandem-health` (the pod's readiness probe, `cli/health.py`), the unit's supervisor and
the HTTP gateway's `/health`. A unit is *ready* (for speech) when at least one speech engine is
published, every published speech engine is up, no engine drains and no speech stub is silent.
Nothing here imports Triton or torch.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tandem.serving.stub_guard import PERIOD_S

ENGINE_UP = "tandem_engine_up"
DRAINING = "tandem_draining"
HEARTBEAT = "tandem_stub_heartbeat_timestamp_seconds"
STUB_SILENT_S = 4.0  # heartbeats come every second (stub_guard.PERIOD_S)
VOICES_MODELS = frozenset({"voices"})  # registration: a failure domain of its own, apart from speech


@dataclass(frozen=True)
class EngineState:
    model: str
    model_instance: str
    up: bool
    draining: bool


@dataclass(frozen=True)
class UnitHealth:
    """What the metrics say about the unit. `reasons` names every speech engine that is down or
    draining and every silent speech stub; `voices_reasons` the same for registration."""

    engines: tuple[EngineState, ...]
    silent_stubs: tuple[tuple[str, str, float], ...] = ()  # (model, model_instance, seconds silent)

    def part(self, voices: bool) -> UnitHealth:
        """The engines and silent stubs of one failure domain: registration (`voices`) or speech."""
        return UnitHealth(
            tuple(e for e in self.engines if (e.model in VOICES_MODELS) == voices),
            tuple(s for s in self.silent_stubs if (s[0] in VOICES_MODELS) == voices),
        )

    @property
    def speech(self) -> UnitHealth:
        return self.part(voices=False)

    @property
    def voices(self) -> UnitHealth:
        return self.part(voices=True)

    @property
    def stubs_alive(self) -> bool:
        return not self.speech.silent_stubs

    @property
    def engines_up(self) -> bool:
        return _up(self.speech)

    @property
    def draining(self) -> bool:
        return any(e.draining for e in self.speech.engines)

    @property
    def ready(self) -> bool:
        return self.engines_up and not self.draining

    @property
    def reasons(self) -> tuple[str, ...]:
        return _reasons(self.speech, f"no {ENGINE_UP} published: no engine has started")

    @property
    def voices_ready(self) -> bool:
        return _up(self.voices)

    @property
    def voices_reasons(self) -> tuple[str, ...]:
        return _reasons(self.voices, f"no {ENGINE_UP} of a voices model: registration is not served")


def _up(part: UnitHealth) -> bool:
    return bool(part.engines) and all(e.up for e in part.engines) and not part.silent_stubs


def _reasons(part: UnitHealth, none: str) -> tuple[str, ...]:
    if not part.engines and not part.silent_stubs:
        return (none,)
    out = [f"{m} {i}: stub silent for {s:.1f} s (dead or stopped)" for m, i, s in part.silent_stubs]
    out += [f"{e.model} {e.model_instance}: engine down" for e in part.engines if not e.up]
    out += [f"{e.model} {e.model_instance}: draining" for e in part.engines if e.draining]
    return tuple(out)


class HealthUnavailable(Exception):
    """The metrics endpoint could not be read (server down, wrong URL, timeout)."""


def parse_health(metrics_text: str, now: float | None = None, unit_clock: bool = False) -> UnitHealth:
    """Build the unit's health from one scrape of Triton's metrics text (Prometheus exposition format).

    Samples are keyed by (model, model_instance); a draining sample without an engine_up sample still
    counts (as an engine that is up, since it publishes). An engine whose stub is silent is down.
    `now`: the Unix time to judge heartbeats by (default: this machine's clock); `unit_clock`: judge
    them by the unit's own clock instead, its newest heartbeat plus one period (for a reader on
    another host, whose clock may be off by more than STUB_SILENT_S)."""
    up: dict[tuple[str, str], bool] = {}
    draining: dict[tuple[str, str], bool] = {}
    beats: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name not in (ENGINE_UP, DRAINING, HEARTBEAT):
            continue
        for sample in family.samples:
            key = (sample.labels.get("model", ""), sample.labels.get("model_instance", ""))
            if family.name == HEARTBEAT:
                beats[key] = sample.value
            else:
                target = up if family.name == ENGINE_UP else draining
                target[key] = sample.value >= 0.5
    if unit_clock and beats:
        now = max(beats.values()) + PERIOD_S
    elif now is None:
        now = time.time()
    silent = {k: now - t for k, t in beats.items() if now - t > STUB_SILENT_S}
    keys = sorted(set(up) | set(draining))
    return UnitHealth(
        tuple(
            EngineState(m, i, up.get((m, i), True) and (m, i) not in silent, draining.get((m, i), False))
            for m, i in keys
        ),
        tuple((m, i, s) for (m, i), s in sorted(silent.items())),
    )


def fetch_health(metrics_url: str, timeout_s: float = 2.0, unit_clock: bool = False) -> UnitHealth:
    """Scrape `metrics_url` once (`unit_clock`: as `parse_health`). Raises `HealthUnavailable` when it
    cannot be read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise HealthUnavailable(f"cannot read {metrics_url}: {exc}") from None
    return parse_health(text, unit_clock=unit_clock)
