"""`tandem-unit` owns its server's readiness: not ready while an engine or stub speech needs is down.

Triton 2.51 cannot see an engine worker (it lives behind a stub) and keeps a model whose stub died
READY, so its `/v2/health/ready` (and gRPC `ServerReady`) said ready through every such outage. Its
readiness is strict (`--strict-readiness`, on by default): the server is ready only while every model
it knows is READY or was unloaded. So the unit makes it false by loading a model of its own that
cannot load, and true again by loading that model so that it can:

* **mark** (not ready): `POST /v2/repository/models/tandem_unit_not_ready/load` carrying its config
  and a file (the repository API's file override: nothing is written to the repository, which may
  be read-only) for a backend that does not exist. The load fails at once (no process starts) and
  the model stays UNAVAILABLE with that failure: `/v2/health/ready` answers 400 (Triton's "not
  ready"), `ServerReady` false. Every model still serves what it can; nothing is unloaded.
* **clear** (ready): the same name loaded as an ensemble of one step over a model the server runs
  (the front end where there is one; its inputs and outputs): READY, no process, and the server is
  ready again. The next mark unloads it first (Triton keeps a READY version serving through a failed
  reload). A python model would do as well in principle, but loading one started a stub, and once,
  right after a reload, Triton stopped answering every other stub for 60 s while it did and then
  aborted: the unit starts no process for its readiness.

The supervisor marks at once when a speech model's stub dies (by pid, `serving/stub_healing.py`) or
its metrics say a speech engine is down or a speech stub is silent (`serving/health.py`), and clears
once all of that has been well for `CLEAR_AFTER_S`. `voices` is its own failure domain and never
marks. With `--model-control-mode` other than explicit, or `--strict-readiness=false`, there is no way
to mark: the unit says so once and goes on. Nothing here imports Triton or torch.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tandem.serving.control_api import ControlApi, ControlError

MARK_MODEL = "tandem_unit_not_ready"
CLEAR_AFTER_S = 1.0  # everything well this long before the server is called ready again
MARK_RETRY_S = 0.5  # a mark the server refused for a passing reason is tried again this much later
_IO = {
    "max_batch_size": 0,
    "input": [{"name": "NOT_READY", "data_type": "TYPE_INT32", "dims": [1]}],
    "output": [{"name": "REASON", "data_type": "TYPE_STRING", "dims": [1]}],
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}
# The model that cannot load: no backend of this name exists, so Triton fails it without a process.
_DOWN_CONFIG = {"name": MARK_MODEL, "backend": "tandem_unit_engine_down", **_IO}
STEP_PREFERRED = "frontend"  # the clear's one step where the repository has it (stateless, light)
MARK_TIMEOUT_S = 5.0  # a mark or clear the server does not answer this fast is tried again


def ensemble_over(model: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The clear's config: an ensemble named MARK_MODEL of one step, `model`, with its inputs and
    outputs passed through (no process of its own)."""
    inputs = [dict(t) for t in config.get("input") or []]
    outputs = [dict(t) for t in config.get("output") or []]
    return {
        "name": MARK_MODEL,
        "platform": "ensemble",
        "max_batch_size": int(config.get("max_batch_size", 0)),
        "input": inputs,
        "output": outputs,
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": model,
                    "model_version": -1,
                    "input_map": {t["name"]: t["name"] for t in inputs},
                    "output_map": {t["name"]: t["name"] for t in outputs},
                }
            ]
        },
    }


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class ReadinessMark:
    """The unit's say over one server's readiness; `update(down)` each poll."""

    def __init__(self, api: ControlApi, log: Callable[[str], None]) -> None:
        self.api = api
        self.log = log
        self.marked = False  # the server is held not ready by the mark
        self.loaded = False  # the mark model is loaded READY (cleared before): unload before marking
        self.clear_config: dict[str, Any] | None = None  # the ensemble the clear loads
        self.broken = False  # marking failed once: said so, not tried again this server lifetime
        self.well_since: float | None = None
        self.retry_at = 0.0
        self.marked_at = 0.0
        self.why: tuple[str, ...] = ()

    def reset(self) -> None:
        """A new server: it knows no mark."""
        self.marked = self.loaded = self.broken = False
        self.well_since = None
        self.retry_at = 0.0
        self.why = ()
        self.clear_config = None

    def update(self, down: Sequence[str]) -> None:
        """`down`: what speech lacks now (empty: all well)."""
        if self.broken:
            return
        now = time.monotonic()
        if down:
            self.well_since = None
            if not self.marked and now >= self.retry_at:
                self._mark(tuple(down))
            return
        if not self.marked:
            return
        self.well_since = self.well_since or now
        if now - self.well_since >= CLEAR_AFTER_S:
            self._clear()

    def _clear_config(self) -> dict[str, Any]:
        """The clear's ensemble, over the front end or else the first READY model that is not an
        ensemble (read before the first mark, while every model serves)."""
        if self.clear_config is None:
            states = self.api.index(timeout_s=MARK_TIMEOUT_S)
            ready = [m for m, (state, _) in states.items() if state == "READY" and m != MARK_MODEL]
            for model in sorted(ready, key=lambda m: (m != STEP_PREFERRED, m)):
                config = self.api.config(model, timeout_s=MARK_TIMEOUT_S)
                if config.get("platform") != "ensemble" and config.get("output"):
                    self.clear_config = ensemble_over(model, config)
                    break
            else:
                raise ControlError("no model to build the clear's ensemble over", 404)
        return self.clear_config

    def _mark(self, why: tuple[str, ...]) -> None:
        params = {"config": json.dumps(_DOWN_CONFIG), "file:1/NOT_READY": _b64("; ".join(why))}
        try:
            self._clear_config()  # known before the server is held not ready: the way back
            if self.loaded:
                self.api.unload(MARK_MODEL, timeout_s=MARK_TIMEOUT_S)
                self.loaded = False
            self.api.load(MARK_MODEL, params, timeout_s=MARK_TIMEOUT_S)
        except ControlError as exc:
            if exc.status == 400 and "load failed" in str(exc):  # as meant: the mark cannot load
                self.marked, self.marked_at, self.why = True, time.monotonic(), why
                self.log(f"server marked not ready (/v2/health/ready false): {'; '.join(why)}")
                return
            if exc.status in (None, 400, 409, 500) and "no model to build" not in str(exc):  # busy: again
                self.retry_at = time.monotonic() + MARK_RETRY_S
                self.log(f"could not mark the server not ready yet ({exc}); trying again")
                return
            self.broken = True  # e.g. 403/503: the repository API is not ours to use
            self.log(
                f"cannot mark the server not ready ({exc}): its /v2/health/ready stays as Triton says "
                "(explicit model control and strict readiness are needed); tandem-health still tells"
            )
            return
        self.broken = True
        self.log(f"cannot mark the server not ready: {MARK_MODEL} loaded although it cannot")

    def _clear(self) -> None:
        assert self.clear_config is not None  # built by the mark
        params = {"config": json.dumps(self.clear_config), "file:1/NOT_READY": _b64("ready")}
        try:
            self.api.load(MARK_MODEL, params, timeout_s=MARK_TIMEOUT_S)
        except ControlError as exc:
            self.log(f"cannot clear the not-ready mark yet ({exc}); trying again")
            self.well_since = time.monotonic()  # the next try after CLEAR_AFTER_S
            return
        self.marked, self.loaded = False, True
        took = time.monotonic() - self.marked_at
        self.log(f"server ready again (/v2/health/ready true), {took:.1f} s after the mark")
