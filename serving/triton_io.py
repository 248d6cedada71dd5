"""The one place that converts between Triton tensors and tandem's domain values.

Every `model_repository/*/model.py` is a thin adapter: it reads its config, builds an engine from
`tandem.backend`, and uses this module to turn requests into domain values, engine output into
responses, engine errors into `TritonError`s, and engine metrics into `pb_utils.MetricFamily`s.
`pb` is the `triton_python_backend_utils` module, passed in rather than imported so this module is
importable (and testable) outside Triton.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.backend.config import Limits, ModelConfig, VocoderConfig
from tandem.backend.decoder import Decoder
from tandem.backend.errors import ErrorCode, InvalidInput, TandemError
from tandem.backend.metrics import METRICS, Engine, Kind, zero_series
from tandem.backend.prompt import RequestParams, check_prompt, parse_params
from tandem.backend.runtime import build_decoder, resolve_device
from tandem.backend.settings import EngineSettings, parse_settings, triton_parameters
from tandem.backend.stream import Chunk
from tandem.backend.timing import Timings

OPTIONAL_INPUTS = ("MAX_TOKENS", "TEMPERATURE", "TOP_P", "TOP_K", "SEED", "VOICE_ID")


def setup_logging(model_name: str) -> None:
    """Engine logs go to the stub's stderr, which Triton copies into its own log."""
    log = logging.getLogger("tandem")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s tandem[{model_name}] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def load_settings(args: Mapping[str, Any]) -> tuple[EngineSettings, dict[str, Any]]:
    model_config = json.loads(args["model_config"])
    return parse_settings(triton_parameters(model_config)), model_config


def triton_error(pb: Any, err: BaseException) -> Any:
    code = err.code if isinstance(err, TandemError) else ErrorCode.INTERNAL
    codes = {
        ErrorCode.INVALID_ARG: pb.TritonError.INVALID_ARG,
        ErrorCode.UNAVAILABLE: pb.TritonError.UNAVAILABLE,
        ErrorCode.CANCELLED: pb.TritonError.CANCELLED,
        ErrorCode.INTERNAL: pb.TritonError.INTERNAL,
    }
    message = str(err) if isinstance(err, TandemError) else f"[INTERNAL] {type(err).__name__}: {err}"
    return pb.TritonError(message, codes[code])


def _input(pb: Any, request: Any, name: str) -> np.ndarray | None:
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def read_request(pb: Any, request: Any, cfg: ModelConfig, limits: Limits) -> tuple[np.ndarray, RequestParams]:
    """PROMPT and the optional inputs of the client contract; raises InvalidInput naming the problem."""
    prompt = _input(pb, request, "PROMPT")
    if prompt is None:
        raise InvalidInput("PROMPT is required")
    params = parse_params({name: _input(pb, request, name) for name in OPTIONAL_INPUTS}, cfg, limits)
    return check_prompt(prompt, cfg, limits), params


def stream_id(request: Any) -> int:
    """The client's stream id (Triton correlation id); 0 when the request carries none."""
    corr = request.correlation_id()
    return int(corr) if isinstance(corr, int) else 0


def publish_parameters(cfg: ModelConfig, voc: VocoderConfig) -> dict[str, str]:
    """What `tts`/`tts_mono` publish in their config so clients need not read code."""
    return {
        "row_width": str(cfg.row_width),
        "vocab_size": str(cfg.vocab_size),
        "sample_rate": str(voc.sample_rate),
        "rows_per_second": str(voc.rows_per_second),
    }


def bytes_tensor(pb: Any, name: str, text: str) -> Any:
    return pb.Tensor(name, np.array([text.encode()], dtype=np.object_))


class _DecoupledResponder:
    """One stream's decoupled response sender: data responses, then FINAL, or one FINAL error.

    After the final response or the error nothing more is sent (a late emit from the engine thread
    is dropped rather than sent after FINAL, which Triton would reject).
    """

    def __init__(self, pb: Any, request: Any) -> None:
        self._pb = pb
        self._sender = request.get_response_sender()
        self._closed = False

    def _send(self, outputs: list[Any], final: bool) -> None:
        if self._closed:
            return
        self._closed = final
        flags = self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self._sender.send(self._pb.InferenceResponse(output_tensors=outputs), flags=flags)

    def fail(self, error: TandemError) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.send(
            self._pb.InferenceResponse(error=triton_error(self._pb, error)),
            flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def cancelled(self) -> bool:
        return bool(self._sender.is_cancelled())


class ResponseSink(_DecoupledResponder):
    """ChunkSink: `render(chunk)` builds one response's outputs; the final chunk's carries FINAL.
    Called from the engine thread."""

    def __init__(self, pb: Any, request: Any, render: Callable[[Chunk], list[Any]]) -> None:
        super().__init__(pb, request)
        self._render = render

    def emit(self, chunk: Chunk) -> None:
        if not self._closed:
            self._send(self._render(chunk), chunk.final)


def timings_text(chunk: Chunk, extra: Mapping[str, int] | None = None) -> str:
    t = Timings(chunk.timings.as_dict() if chunk.timings else {})
    if extra:
        t.update(extra)
    return t.to_json()


class TritonMetrics:
    """MetricsSink publishing on Triton's /metrics endpoint, one per model instance.

    Families must outlive their metrics (the backend refuses to update a metric whose family was
    collected), so this object keeps both for the model's lifetime. Every series `engine` declares in
    `zero_labels` is created here, at 0, so alerts see 0 rather than no data before the first event.
    """

    def __init__(self, pb: Any, const_labels: Mapping[str, str], engine: Engine) -> None:
        self._pb = pb
        self._const = dict(const_labels)
        kinds = {
            Kind.COUNTER: pb.MetricFamily.COUNTER,
            Kind.GAUGE: pb.MetricFamily.GAUGE,
            Kind.HISTOGRAM: pb.MetricFamily.HISTOGRAM,
        }
        self._families = {
            m.name: pb.MetricFamily(name=m.name, description=m.description, kind=kinds[m.kind])
            for m in METRICS
        }
        self._defs = {m.name: m for m in METRICS}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for name, labels in zero_series(engine):
            self._metric(name, labels)

    def _metric(self, name: str, labels: Mapping[str, str]) -> Any:
        merged = {**self._const, **labels}
        key = (name, tuple(sorted(merged.items())))
        metric = self._metrics.get(key)
        if metric is None:
            d = self._defs[name]
            if d.kind == Kind.HISTOGRAM:
                metric = self._families[name].Metric(labels=merged, buckets=list(d.buckets))
            else:
                metric = self._families[name].Metric(labels=merged)
            self._metrics[key] = metric
        return metric

    def set(self, name: str, value: float, **labels: str) -> None:
        self._metric(name, labels).set(float(value))

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        self._metric(name, labels).increment(float(by))

    def observe(self, name: str, value: float, **labels: str) -> None:
        self._metric(name, labels).observe(float(value))


def check_published(model_config: Mapping[str, Any], cfg: ModelConfig, voc: VocoderConfig) -> None:
    """Refuse to load when the config's published parameters disagree with the loaded model."""
    published = {k: v.get("string_value") for k, v in (model_config.get("parameters") or {}).items()}
    for key, actual in publish_parameters(cfg, voc).items():
        if key in published and published[key] != actual:
            raise ValueError(
                f"config.pbtxt publishes {key}={published[key]} but the loaded model has {key}={actual}; "
                "fix the published parameter so clients build valid prompts"
            )


def sampling_params(params: RequestParams) -> Any:
    """Fix the request's seed here, at entry: every later process samples with the same one."""
    from tandem.backend.sampling import SamplingParams

    seed = params.seed if params.seed is not None else int.from_bytes(np.random.bytes(7), "little")
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)


class HandoffResponder(_DecoupledResponder):
    """HandoffSink: exactly one response (HANDOFF) or one error, FINAL."""

    def send(self, handoff: Any) -> None:
        self._send([bytes_tensor(self._pb, "HANDOFF", handoff.to_json())], final=True)


@dataclass(frozen=True)
class EngineContext:
    """What every engine model builds in `initialize`: settings, its config, decoder and metrics."""

    settings: EngineSettings
    config: dict[str, Any]
    decoder: Decoder
    metrics: TritonMetrics


def engine_context(pb: Any, args: Mapping[str, Any], engine: Engine) -> EngineContext:
    """Logging, typed settings, the decoder on the instance's device, and `engine`'s metrics labelled
    `model` and `model_instance` — the common start of the `prefill`, `decode` and `tts_mono` adapters."""
    setup_logging(args["model_name"])
    settings, config = load_settings(args)
    device = resolve_device(
        settings.device, args["model_instance_kind"], int(args["model_instance_device_id"])
    )
    decoder = build_decoder(settings, device)
    labels = {"model": args["model_name"], "model_instance": args["model_instance_name"]}
    metrics = TritonMetrics(pb, labels, engine)
    return EngineContext(settings, config, decoder, metrics)
