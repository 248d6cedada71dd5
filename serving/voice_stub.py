"""What the `voices` adapter does: check a voice request, forward it to the registrar's worker, answer.

The registrar (`backend/voices/registrar.py`) runs in the model's own worker process, started and
supervised by `EngineWorker` exactly as the engines are (`serving/engine_worker.py`): this stub's
execute thread only runs the checks that cost nothing (`parse_voice_request`: the action, the name,
the transcript, the file's size; the same checks the worker repeats) and queues a Submit; the answer
(RESULT: JSON) or the error comes back on the worker's relay thread through `TritonResponder`. So a
registration that encodes for a minute never holds an execute thread, and its stall watchdog
(`tandem.worker.stall_timeout_s`, 300 s in the model's config) only fires for an encoder stuck
longer than any reference can take.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from tandem.backend.errors import TandemError
from tandem.backend.metrics import WORKER_METRICS, MetricsSink
from tandem.backend.text.frontend import builtin_voices
from tandem.backend.voices.request import parse_voice_request
from tandem.backend.worker.channel import Array, EngineKind, Submit
from tandem.serving import triton_io as io
from tandem.serving.engine_stub import TritonResponder
from tandem.serving.engine_worker import EngineWorker


class VoiceStub:
    """The `voices` model instance's stub."""

    def __init__(self, pb: Any, args: Mapping[str, Any], health: MetricsSink | None = None) -> None:
        """`health`: the stub guard's sink for the worker's up/down (as `EngineStub`'s)."""
        io.setup_logging(args["model_name"])
        self._pb = pb
        self.settings, self.config = io.load_settings(args)
        labels = {"model": str(args["model_name"]), "model_instance": str(args["model_instance_name"])}
        metrics = io.TritonMetrics(pb, labels, names=())
        if health is None:
            health = io.TritonMetrics(pb, labels, names=WORKER_METRICS)
        self.builtin = builtin_voices(self.settings)
        self.worker = EngineWorker(args, EngineKind.VOICES, self.settings.worker, metrics, health)
        self.worker.start()

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            responder = TritonResponder(self._pb, request)
            try:
                raw = io.read_voice_inputs(self._pb, request)
                parse_voice_request(raw, self.settings.voices, self.builtin)
            except TandemError as err:
                responder.fail(err)
                continue
            inputs = {k: Array("BYTES", (1,), v) for k, v in raw.items() if v is not None}
            self.worker.submit(functools.partial(_submit, inputs=inputs), responder)

    def close(self) -> None:
        self.worker.close()


def _submit(req_id: int, inputs: dict[str, Array]) -> Submit:
    return Submit(req_id=req_id, stream_id=0, timings={}, inputs=inputs)
