"""What the `prefill`, `decode` and `tts_mono` adapters do: validate, forward to the worker, answer.

`EngineStub` is the whole body of those three `model.py` files. `initialize()` builds one: settings
from the model's config, the metrics sinks, and the engine worker (`serving/engine_worker.py`), whose
start it waits for. `execute()` only validates each request — with the same checks and the same
`[INVALID_ARG]` messages as before the split (`triton_io.read_request`, the handoff checks) — and
hands it to the worker; it never waits on the engine. Responses come back on the worker's relay
thread through `TritonResponder`.

The worker owns the engine; this process keeps only what validation needs: the settings, and the
decoder's `ModelConfig` and pool size reported in the worker's Ready.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tandem.backend.codec.builder import codec_spec
from tandem.backend.engines.handoff import Handoff
from tandem.backend.errors import InvalidInput, TandemError
from tandem.backend.metrics import METRICS, STUB_METRICS, WORKER_METRICS, Engine, MetricsSink
from tandem.backend.model.config import ModelConfig
from tandem.backend.timing import PROMPT_ROWS, Timings
from tandem.backend.worker.channel import Array, EngineKind, Reply, Submit
from tandem.serving import triton_io as io
from tandem.serving.cancel_board import CancelBoard
from tandem.serving.engine_worker import EngineUnavailable, EngineWorker
from tandem.transfer.control import control_dir

ENGINES = {EngineKind.PREFILL: Engine.PREFILL, EngineKind.DECODE: Engine.DECODE, EngineKind.MONO: Engine.MONO}


class TritonResponder:
    """One request's decoupled response sender: Replies, then FINAL, or one FINAL error.

    Called from the relay and watchdog threads. `_lock` orders every call on the sender: Triton frees
    the request's response factory once FINAL is sent, and `is_cancelled()` on a freed factory
    crashes the whole server (seen: SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled), so nothing
    touches the sender after FINAL. `posted`: another way the request may be cancelled (D: a
    cancellation on the unit's board, `serving/cancel_board.py`)."""

    def __init__(self, pb: Any, request: Any, posted: Callable[[], bool] | None = None) -> None:
        self._pb = pb
        self._sender = request.get_response_sender()
        self._posted = posted
        self._closed = False
        self._lock = threading.Lock()

    def reply(self, reply: Reply) -> None:
        tensors = io.reply_tensors(self._pb, reply)
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if reply.final else 0
        with self._lock:
            if self._closed:
                return
            self._closed = reply.final
            self._sender.send(self._pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def fail(self, error: TandemError) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sender.send(
                self._pb.InferenceResponse(error=io.triton_error(self._pb, error)),
                flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def cancelled(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            if self._sender.is_cancelled():
                return True
        # The board's directory I/O outside the lock `reply()` needs (a posting used up for a stream
        # that finished meanwhile is harmless).
        return self._posted is not None and self._posted()


class EngineStub:
    """One model instance's stub: `kind` says which engine its worker runs (`tts_mono`: MONO)."""

    def __init__(
        self, pb: Any, args: Mapping[str, Any], kind: EngineKind, health: MetricsSink | None = None
    ) -> None:
        """`health`: where the worker's up/down and restarts go (the stub guard's, `StubGuard.health`,
        so that this process holds one metric object per series; default: a sink of its own)."""
        io.setup_logging(args["model_name"])
        self._pb = pb
        self.kind = kind
        self.settings, self.config = io.load_settings(args)
        model, instance = str(args["model_name"]), str(args["model_instance_name"])
        engine_metrics = [m.name for m in METRICS if m.name not in (*WORKER_METRICS, *STUB_METRICS)]
        labels = {"model": model, "model_instance": instance}
        metrics = io.TritonMetrics(pb, labels, names=engine_metrics, engine=ENGINES[kind])
        if health is None:
            health = io.TritonMetrics(pb, labels, names=WORKER_METRICS)
        self.worker = EngineWorker(args, kind, self.settings.worker, metrics, health)
        ready = self.worker.start()
        self.cfg = ModelConfig(**ready.cfg)
        self.pool_tokens = ready.pool_tokens
        io.check_dims(self.config, self.cfg.row_width)
        if kind == EngineKind.MONO:
            io.check_published(self.config, self.cfg, codec_spec(self.settings))
        # The text front end (tts_mono takes TEXT itself; in `tts` the frontend step did it) and the
        # checkpoint's sampling defaults, grammar and stop ids: validation needs them, not the engine.
        self.frontend = io.text_frontend(args, self.settings, self.cfg) if kind == EngineKind.MONO else None
        self.defaults = (
            None
            if kind == EngineKind.DECODE
            else io.generation_defaults(args, self.settings, self.cfg, self.frontend)
        )
        # D: cancellations of `tts` streams that clients post by stream id (serving/cancel_board.py)
        self.cancels = (
            CancelBoard(control_dir(self.settings.transfer.unit) / "cancels")
            if kind == EngineKind.DECODE
            else None
        )

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            if self.cancels is not None and io.is_cancel(self._pb, request):
                self._post_cancel(request)
                continue
            responder = TritonResponder(self._pb, request, self._posted(request))
            try:
                build = self._handoff(request) if self.kind == EngineKind.DECODE else self._prompt(request)
            except TandemError as err:
                responder.fail(err)
                continue
            self.worker.submit(build, responder)

    def close(self) -> None:
        self.worker.close()

    def _posted(self, request: Any) -> Callable[[], bool] | None:
        if self.cancels is None:
            return None
        board, sid = self.cancels, io.stream_id(request)
        return lambda: board.posted(sid)

    def _post_cancel(self, request: Any) -> None:
        """A `CANCEL` request (D only): post the stream id on the board and answer with one FINAL
        response whose `TIMINGS` is empty (a response, not just the flag: a gRPC stream delivers a
        bare FINAL only to clients that asked for empty final responses); a bad id or an unwritable
        board is the request's error."""
        assert self.cancels is not None
        sender = request.get_response_sender()
        final = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            stream = io.read_cancel(self._pb, request)
            try:
                self.cancels.post(stream)
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
        except TandemError as err:
            sender.send(self._pb.InferenceResponse(error=io.triton_error(self._pb, err)), flags=final)
            return
        except OSError as exc:
            unwritable = EngineUnavailable(f"decode: the cancel board cannot be written: {exc}")
            sender.send(self._pb.InferenceResponse(error=io.triton_error(self._pb, unwritable)), flags=final)
            return
        ack = self._pb.InferenceResponse(output_tensors=[io.timings_tensor(self._pb, "")])
        sender.send(ack, flags=final)

    def _prompt(self, request: Any) -> functools.partial[Submit]:
        timings = Timings()
        timings.mark("entry")
        assert self.defaults is not None  # built for every prompt kind
        prompt, params = io.read_request(
            self._pb, request, self.cfg, self.settings.limits, self.frontend, self.defaults
        )
        timings.mark(PROMPT_ROWS, at=int(prompt.shape[0]))
        return functools.partial(
            _submit,
            stream_id=io.stream_id(request),
            timings=timings.as_dict(),
            prompt=Array.of(np.ascontiguousarray(prompt)),
            sampling=io.sampling_params(params).to_wire(),
            max_new_rows=params.max_new_rows,
        )

    def _handoff(self, request: Any) -> functools.partial[Submit]:
        raw = io.read_handoff(self._pb, request)
        try:
            handoff = Handoff.from_json(raw)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        handoff.check_fits(self.cfg, self.pool_tokens)
        timings = Timings(handoff.timings)
        timings.mark("d_entry")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return functools.partial(
            _submit, stream_id=io.stream_id(request), timings=timings.as_dict(), handoff=text
        )


def _submit(req_id: int, **fields: Any) -> Submit:
    return Submit(req_id=req_id, **fields)
