"""The engines' health as the unit's supervisor reads it, and what it decides from it.

Called by `tandem-unit`'s supervisor (serving/supervisor.py) on its main thread, every
`--poll-interval` while the server runs. It reads the engines' truth from the server's metrics
(`tandem.serving.health`: `tandem_engine_up`, `tandem_draining`, the stubs' heartbeats) and owns, per
server lifetime (`reset` at each start):

* the last reading, and a log line for each engine that goes down or comes back, each stub that
  falls silent, each change of draining;
* the speech engines' grace: `judge` returns why the server must be restarted once some speech
  engine has been down for `--engine-down-grace` seconds (its stub's own restarts did not bring it
  back: a broken device, a start that keeps failing), or a dead stub's model has not come back by
  reloads as long;
* the voices engine's grace: its own failure domain, never the server's: after as long down it
  reloads the `voices` model through the stub healer (serving/stub_healing.py), each further reload
  that did not hold twice as long after the last (up to 16 graces);
* readiness (serving/readiness.py): while a speech stub is dead, a speech engine is down or a
  speech stub is silent, the server says not ready; ready again once all of it is well.

Failure: metrics that do not answer (a starting or busy server) are no reading: the last readiness
mark stands and the supervisor's process check covers the server's death.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tandem.serving.health import VOICES_MODELS, HealthUnavailable, UnitHealth, fetch_health
from tandem.serving.readiness import ReadinessMark
from tandem.serving.stub_healing import StubHealer

VOICES_BACKOFF_STEPS = 4  # voices' grace reloads back off to 16 graces apart at most


class EngineWatch:
    """The engines' health over one server's lifetime; the grace before acting on it."""

    def __init__(
        self,
        metrics_url: str,
        grace_s: float,
        healer: StubHealer,
        readiness: ReadinessMark,
        log: Callable[[str], None],
    ) -> None:
        self.metrics_url = metrics_url
        self.grace_s = grace_s
        self.healer = healer
        self.readiness = readiness
        self.log = log
        self.ever_up = False  # some server of this supervisor's answered the metrics
        self.reset()

    def reset(self) -> None:
        """A new server: nothing read of it yet."""
        self.health: UnitHealth | None = None  # the last reading of the engines
        self.down_since: float | None = None  # some speech engine down since (monotonic)
        self.voices_down_since: float | None = None  # the voices engine down since (monotonic)
        self.voices_up_since: float | None = None  # ... up since
        self.voices_reloads = 0  # grace reloads of voices that did not hold (their wait doubles)

    def read(self) -> UnitHealth | None:
        """Read the engines' health (None: the metrics did not answer); log what changed since the
        last reading that had engines, and keep it."""
        try:
            health: UnitHealth | None = fetch_health(self.metrics_url, timeout_s=2.0)
        except HealthUnavailable:
            health = None  # starting, or between scrapes of a busy server: the process check covers death
        if health is not None:
            self.ever_up = True
            if health.engines:
                self._log_changes(health)
                self.health = health
        return health

    def _log_changes(self, health: UnitHealth) -> None:
        healing = self.healer.down
        before = {(e.model, e.model_instance): e for e in self.health.engines} if self.health else {}
        silent = {(m, i): t for m, i, t in health.silent_stubs}
        was_silent = {(m, i) for m, i, _ in self.health.silent_stubs} if self.health else set()
        for (m, i), t in silent.items():
            if (m, i) not in was_silent:
                self.log(f"{m} {i}: stub silent for {t:.1f} s (its heartbeat stopped)")
        for e in health.engines:
            old = before.get((e.model, e.model_instance))
            aside = "; registration only, speech unaffected" if e.model in VOICES_MODELS else ""
            if old is None and e.up:
                self.log(f"{e.model} {e.model_instance}: engine up")
            elif (old is None or old.up) and not e.up and (e.model, e.model_instance) in silent:
                self.log(f"{e.model} {e.model_instance}: engine down (its stub is silent){aside}")
            elif (old is None or old.up) and not e.up:
                why = (
                    "(its stub died: the model is being reloaded)"
                    if e.model in healing
                    else "(tandem_engine_up 0); its stub restarts it"
                )
                self.log(f"{e.model} {e.model_instance}: engine down {why}{aside}")
            elif old is not None and not old.up and e.up:
                self.log(f"{e.model} {e.model_instance}: engine up again")
            if old is not None and old.draining != e.draining:
                self.log(
                    f"{e.model} {e.model_instance}: {'draining' if e.draining else 'no longer draining'}"
                )

    def judge(self, health: UnitHealth) -> str | None:
        """Act on a reading with engines: reload the voices model after its grace; why the server
        must be restarted (a speech engine or a dead stub's model down past the grace), or None."""
        now = time.monotonic()
        healing = self.healer.down
        if any(m in healing for m in VOICES_MODELS):
            pass  # its reload runs: judged again once it ends
        elif health.voices.engines and not health.voices_ready:
            self.voices_down_since = self.voices_down_since or now
            # a grace for the first reload, then twice as long after each that did not hold
            wait = self.grace_s * 2 ** min(self.voices_reloads, VOICES_BACKOFF_STEPS)
            if now - self.voices_down_since >= wait:
                down = "; ".join(health.voices_reasons)
                self.voices_reloads += 1
                self.log(
                    f"voices down for {now - self.voices_down_since:.0f} s ({down}): reloading the voices "
                    f"model ({self.voices_reloads} in a row), not the server (speech is unaffected)"
                )
                self.voices_down_since = now
                for model in sorted({e.model for e in health.voices.engines}):
                    self.healer.start(model, [])
        else:
            if self.voices_down_since is not None or self.voices_up_since is None:
                self.voices_up_since = now
            elif now - self.voices_up_since >= self.grace_s:
                self.voices_reloads = 0  # it held: the next outage starts from one grace again
            self.voices_down_since = None
        speech_healing = {m: h for m, h in healing.items() if m not in VOICES_MODELS}
        stuck = [m for m, h in speech_healing.items() if now - h.seen_at >= self.grace_s]
        if stuck:  # reloads have not brought a dead stub's model back: the server itself, as a last resort
            return (
                f"{', '.join(stuck)}: its stub died {now - speech_healing[stuck[0]].seen_at:.0f} s ago and "
                "reloads did not bring it back"
            )
        if health.engines_up or speech_healing:
            self.down_since = None  # all up, or a stub reload under way (its own retries)
            return None
        self.down_since = self.down_since or now
        if now - self.down_since >= self.grace_s:
            down = "; ".join(r for r in health.reasons if not r.endswith("draining"))
            return f"engines down for {now - self.down_since:.0f} s: {down}"
        return None

    def update_readiness(self, health: UnitHealth | None, answered: bool) -> None:
        """Hold the server not ready while a speech stub is dead (its reload under way), a speech
        engine is down or a speech stub is silent; ready again once all of it is well. Nothing until
        the server has `answered` a probe: while its models load, Triton says not ready itself."""
        if not answered:
            return
        down = [f"{m}: its stub died (reloading)" for m in self.healer.down if m not in VOICES_MODELS]
        if health is not None and health.speech.engines:
            down += [r for r in health.reasons if not r.endswith("draining")]
        elif health is None and self.readiness.marked:
            return  # the metrics did not answer this time: keep what was said
        self.readiness.update(down)
