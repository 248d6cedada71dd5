"""The one place that converts between Triton tensors and tandem's domain values.

Every `model_repository/*/model.py` is a thin adapter: it reads its config, builds an engine from
`tandem.backend`, and uses this module to turn requests into domain values, engine output into
responses, engine errors into `TritonError`s, and engine metrics into `pb_utils.MetricFamily`s.
`pb` is the `triton_python_backend_utils` module, passed in rather than imported so this module is
importable (and testable) outside Triton.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from tandem.backend.codec.base import CodecSpec, CodecWindow, format_rate
from tandem.backend.errors import ErrorCode, InvalidInput, TandemError
from tandem.backend.metrics import METRICS, Engine, Kind, zero_series
from tandem.backend.model.config import ModelConfig
from tandem.backend.prompt import (
    CONTRACT_DEFAULTS,
    GenerationDefaults,
    RequestParams,
    check_prompt,
    check_text_request,
    parse_params,
)
from tandem.backend.settings import EngineSettings, Limits, parse_settings, triton_parameters
from tandem.backend.text.defaults import load_generation_defaults
from tandem.backend.text.frontend import TextFrontend, build_frontend, model_config
from tandem.backend.voices.store import VoiceStore, resolve_dir
from tandem.backend.worker.channel import Reply
from tandem.wire import contract as wire

# TRITONSERVER_REQUEST_FLAG_SEQUENCE_START (tritonserver.h): the request opens its sequence.
SEQUENCE_START = 1


def setup_logging(model_name: str) -> None:
    """Engine logs go to the stub's stderr, which Triton copies into its own log."""
    log = logging.getLogger("tandem")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s tandem[{model_name}] %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def load_settings(args: Mapping[str, Any]) -> tuple[EngineSettings, dict[str, Any]]:
    """The model's tandem settings and its Triton config; raises ValueError (the model does not
    load) for bad settings or an input with two variable dimensions (`check_dims`)."""
    model_config = json.loads(args["model_config"])
    check_dims(model_config)
    return parse_settings(triton_parameters(model_config)), model_config


def check_dims(model_config: Mapping[str, Any], row_width: int | None = None) -> None:
    """Refuse to load a config that would let a malformed shape reach this stub, or that disagrees
    with the loaded model's row width.

    Every input may have one variable (-1) dimension at most: Triton 2.51 checks a request's byte
    size only when that leaves the element count negative or known, so with two a shape like
    [0, -5] passes its checks and the python backend's numpy conversion aborts the stub process
    (every later request of the model fails). With `row_width`, this model's row tensors
    (`wire/contract.py`, `Shape.ROWS`) must be [-1, row_width]."""
    name = str(model_config.get("name", "?"))
    for t in model_config.get("input") or []:
        dims = [int(d) for d in t.get("dims") or []]
        if sum(d < 0 for d in dims) > 1:
            raise ValueError(
                f"config.pbtxt of {name!r}: input {t.get('name')!r} has dims {dims}; at most one may be "
                "-1 (fix the width to the model's, as tandem-repo writes it)"
            )
    if row_width is None:
        return
    model = wire.MODELS.get(name)
    rows = model.names(wire.Shape.ROWS) if model is not None else ()
    for t in [*(model_config.get("input") or []), *(model_config.get("output") or [])]:
        dims = [int(d) for d in t.get("dims") or []]
        if t.get("name") in rows and dims != [-1, row_width]:
            raise ValueError(
                f"config.pbtxt of {name!r}: {t.get('name')!r} has dims {dims} but the loaded model's rows "
                f"are {row_width} wide; render the repository with tandem-repo for this model"
            )


def triton_error(pb: Any, err: BaseException) -> Any:
    code = err.code if isinstance(err, TandemError) else ErrorCode.INTERNAL
    codes = {
        ErrorCode.INVALID_ARG: pb.TritonError.INVALID_ARG,
        ErrorCode.UNAVAILABLE: pb.TritonError.UNAVAILABLE,
        ErrorCode.CANCELLED: pb.TritonError.CANCELLED,
        ErrorCode.INTERNAL: pb.TritonError.INTERNAL,
        ErrorCode.ALREADY_EXISTS: pb.TritonError.ALREADY_EXISTS,
        ErrorCode.NOT_FOUND: pb.TritonError.NOT_FOUND,
    }
    message = str(err) if isinstance(err, TandemError) else f"[INTERNAL] {type(err).__name__}: {err}"
    return pb.TritonError(message, codes[code])


def _input(pb: Any, request: Any, name: str) -> np.ndarray | None:
    """The request's input `name` as numpy, None when it does not carry it: the one read of a Triton
    input tensor."""
    tensor = pb.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def _text(raw: object) -> str:
    """One BYTES element as text (the python backend hands bytes, some clients str)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _text_request(pb: Any, request: Any, frontend: TextFrontend | None) -> Any:
    prompt = _input(pb, request, wire.PROMPT.name)
    limit = None if frontend is None else frontend.max_text_bytes
    text, voice = _input(pb, request, wire.TEXT.name), _input(pb, request, wire.VOICE.name)
    return prompt, check_text_request(prompt, text, voice, limit)


def read_request(
    pb: Any,
    request: Any,
    cfg: ModelConfig,
    limits: Limits,
    frontend: TextFrontend | None = None,
    defaults: GenerationDefaults = CONTRACT_DEFAULTS,
) -> tuple[np.ndarray, RequestParams]:
    """The prompt rows and the optional inputs of the client contract; raises InvalidInput naming
    the problem. The rows are the checked PROMPT or, with a `frontend`, the rows of TEXT (+ VOICE);
    absent inputs take the model's `defaults` (`generation_defaults`).

    A request without a stream id, or one that does not start its stream, is refused first.
    `tts_mono`'s sequence batcher refuses both before this runs; inside `tts` nothing else stops them
    before P's forward, and D's sequence batcher then refuses the handoff, so P's offered pages would
    sit unpulled for `ticket_ttl_s` (docs/abuse.md): a cheap request that wears P down. (A stream is
    one request today; a request continuing an open stream is refused here too.)"""
    if not has_stream_id(request):
        raise InvalidInput(
            "the request has no stream id: set sequence_id (with sequence_start and sequence_end)"
        )
    if not request.flags() & SEQUENCE_START:
        raise InvalidInput("a stream starts with sequence_start set (one request per stream: start and end)")
    prompt, text = _text_request(pb, request, frontend)
    inputs = {spec.name: _input(pb, request, spec.name) for spec in wire.SAMPLING}
    params = parse_params(inputs, cfg, limits, defaults)
    if text is None:
        rows = check_prompt(prompt, cfg, limits)
    else:
        assert frontend is not None  # check_text_request refuses TEXT without one
        rows = frontend.rows(text)
    return rows, dataclasses.replace(params, grammar_start=int(rows.shape[0]))


def voice_store(settings: EngineSettings) -> VoiceStore:
    """The unit's registered voices (`tandem.voices.dir`; "" = the XDG state default, read from
    this process's environment here, the one place that reads it)."""
    return VoiceStore(resolve_dir(settings.voices.dir, os.environ))


def text_frontend(
    args: Mapping[str, Any], settings: EngineSettings, cfg: ModelConfig, voices: bool = True
) -> TextFrontend | None:
    """The model's text front end (None: it refuses TEXT); a relative tokenizer path is relative to
    the model's directory in the repository (`args["model_repository"]`). `voices`: it speaks with
    the registered voices too (the models that take TEXT)."""
    store = voice_store(settings) if voices else None
    return build_frontend(settings, cfg, args["model_repository"], store)


def generation_defaults(
    args: Mapping[str, Any], settings: EngineSettings, cfg: ModelConfig, frontend: TextFrontend | None = None
) -> GenerationDefaults:
    """The model's sampling defaults, grammar and stop ids (`backend/text/defaults.py`), for the models
    that validate requests (`prefill`, `tts_mono`). Without a `frontend` one is built for the family
    (from the checkpoint's tokenizer) and dropped."""
    if frontend is None:
        frontend = text_frontend(args, settings, cfg, voices=False)
    return load_generation_defaults(settings, cfg, frontend)


def frontend_step(args: Mapping[str, Any]) -> TextFrontend | None:
    """What the `frontend` step builds in `initialize`: logging, settings, the model's config (no
    weights) and its text front end."""
    setup_logging(args["model_name"])
    settings, config = load_settings(args)
    cfg = model_config(settings)
    check_dims(config, cfg.row_width)
    return text_frontend(args, settings, cfg)


def read_frontend_request(pb: Any, request: Any, frontend: TextFrontend | None) -> np.ndarray:
    """The `frontend` step's one output: a PROMPT exactly as it came (`prefill` checks it, so its
    errors are those of a PROMPT request without the step) or the rows of TEXT (+ VOICE)."""
    prompt, text = _text_request(pb, request, frontend)
    if text is None:
        return np.asarray(prompt)
    assert frontend is not None
    return frontend.rows(text)


def frontend_tensors(pb: Any, rows: np.ndarray) -> list[Any]:
    """The `frontend` step's response: its one output, ROWS."""
    return [pb.Tensor(wire.ROWS.name, rows)]


def read_voice_inputs(pb: Any, request: Any) -> dict[str, bytes | None]:
    """A `voices` request's BYTES [1] inputs (`backend/voices/request.py` INPUTS) as bytes, None
    where absent; InvalidInput for one that is not a single element."""
    from tandem.backend.voices.request import INPUTS

    out: dict[str, bytes | None] = {}
    for name in INPUTS:
        arr = _input(pb, request, name)
        if arr is None:
            out[name] = None
            continue
        if arr.size != 1:
            raise InvalidInput(f"{name} must be one BYTES element, got shape {list(arr.shape)}")
        value = arr.reshape(-1)[0]
        out[name] = value if isinstance(value, bytes) else str(value).encode()
    return out


def is_cancel(pb: Any, request: Any) -> bool:
    """A `decode` request that carries CANCEL (a stream id to cancel) rather than a HANDOFF."""
    return pb.get_input_tensor_by_name(request, wire.CANCEL.name) is not None


def read_cancel(pb: Any, request: Any) -> int:
    """The stream id a CANCEL request names; InvalidInput when it also carries a HANDOFF or its
    CANCEL is not one id."""
    if pb.get_input_tensor_by_name(request, wire.HANDOFF.name) is not None:
        raise InvalidInput(f"a request carries one of {wire.HANDOFF.name} and {wire.CANCEL.name}, not both")
    ids = np.asarray(_input(pb, request, wire.CANCEL.name)).reshape(-1)
    if ids.size != 1:
        raise InvalidInput(f"{wire.CANCEL.name} holds one stream id, got {ids.size}")
    return int(ids[0])


def read_handoff(pb: Any, request: Any) -> bytes | str:
    """A `decode` request's HANDOFF element as it came (P's JSON ticket); InvalidInput when absent."""
    arr = _input(pb, request, wire.HANDOFF.name)
    if arr is None:
        raise InvalidInput(
            f"{wire.HANDOFF.name} is required (or {wire.CANCEL.name}, to cancel a stream by its id)"
        )
    raw = arr[0]
    return raw if isinstance(raw, bytes) else str(raw)


def read_chunk(pb: Any, request: Any) -> tuple[np.ndarray, CodecWindow, str]:
    """A `vocoder` request: its rows (TOKENS), its codec window (CODES + WINDOW) and D's stamps
    (TIMINGS) as text. Raises for a request without them or with a bad window."""
    rows, codes, window, timings = (_input(pb, request, t.name) for t in wire.VOCODER.inputs)
    if rows is None or codes is None or window is None or timings is None:
        raise InvalidInput("a vocoder request carries TOKENS, CODES, WINDOW and TIMINGS")
    return rows, CodecWindow.from_arrays(codes, window), _text(timings[0])


def chunk_tensors(pb: Any, rows: np.ndarray, audio: np.ndarray, timings: str) -> list[Any]:
    """The `vocoder` step's response: the rows passed on, the chunk's PCM and the stamps."""
    return [
        pb.Tensor(wire.TOKENS_OUT.name, rows),
        pb.Tensor(wire.AUDIO.name, audio.astype(wire.AUDIO.dtype.numpy, copy=False)),
        bytes_tensor(pb, wire.TIMINGS_OUT.name, timings),
    ]


def has_stream_id(request: Any) -> bool:
    """The request carries a correlation id (a non-zero integer or a non-empty string)."""
    corr = request.correlation_id()
    return corr not in (None, 0, "")


def stream_id(request: Any) -> int:
    """The client's stream id (Triton correlation id); 0 when the request carries none."""
    corr = request.correlation_id()
    return int(corr) if isinstance(corr, int) else 0


def publish_parameters(cfg: ModelConfig, codec: CodecSpec) -> dict[str, str]:
    """What `tts`/`tts_mono` publish in their config so clients need not read code; the audio clock
    is the codec's (backend/codec/builder.py `codec_spec`)."""
    return {
        "row_width": str(cfg.row_width),
        "vocab_size": str(cfg.vocab_size),
        "sample_rate": str(codec.sample_rate),
        "rows_per_second": format_rate(codec.rows_per_second),
    }


def bytes_tensor(pb: Any, name: str, text: str) -> Any:
    return pb.Tensor(name, np.array([text.encode()], dtype=np.object_))


def reply_tensors(pb: Any, reply: Reply) -> list[Any]:
    """A worker's Reply as the Triton tensors of its model's response: P's `HANDOFF`; D's `TOKENS`,
    `CODES`, `WINDOW` (the vocoder step's inputs) and `TIMINGS`; `tts_mono`'s `TOKENS`, `AUDIO` and
    `TIMINGS` (empty except on the final response); the voice registrar's `RESULT`."""
    if reply.handoff:
        return [bytes_tensor(pb, wire.HANDOFF.name, reply.handoff)]
    if reply.result:
        return [bytes_tensor(pb, wire.RESULT.name, reply.result)]
    named = (
        (wire.TOKENS, reply.rows),
        (wire.CODES, reply.frames),
        (wire.WINDOW, reply.window),
        (wire.AUDIO, reply.audio),
    )
    tensors = [pb.Tensor(spec.name, a.numpy()) for spec, a in named if a is not None]
    tensors.append(timings_tensor(pb, reply.timings))
    return tensors


def timings_tensor(pb: Any, stamps: str) -> Any:
    """A response's TIMINGS (JSON stamps; "" for none)."""
    return bytes_tensor(pb, wire.TIMINGS.name, stamps)


class TritonMetrics:
    """MetricsSink publishing on Triton's /metrics endpoint, one per model instance.

    Families must outlive their metrics (the backend refuses to update a metric whose family was
    collected), so this object keeps both for the model's lifetime. Every series `engine` declares in
    `zero_labels` is created here, at 0, so alerts see 0 rather than no data before the first event.
    """

    def __init__(
        self,
        pb: Any,
        const_labels: Mapping[str, str],
        names: Collection[str] | None = None,
        engine: Engine | None = None,
    ) -> None:
        """`names`: the families this sink creates and publishes (default: every one in METRICS);
        `engine`: whose `zero_labels` series it creates at 0 (those of its families)."""
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
            if names is None or m.name in names
        }
        self._defs = {m.name: m for m in METRICS}
        self._metrics: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for name, labels in zero_series(engine) if engine is not None else ():
            if name in self._families:
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


def check_published(model_config: Mapping[str, Any], cfg: ModelConfig, codec: CodecSpec) -> None:
    """Refuse to load when the config's published parameters disagree with the loaded model."""
    published = {k: v.get("string_value") for k, v in (model_config.get("parameters") or {}).items()}
    for key, actual in publish_parameters(cfg, codec).items():
        if key in published and published[key] != actual:
            raise ValueError(
                f"config.pbtxt publishes {key}={published[key]} but the loaded model has {key}={actual}; "
                "fix the published parameter so clients build valid prompts"
            )


def sampling_params(params: RequestParams) -> Any:
    """Fix the request's seed here, at entry: every later process samples with the same one."""
    from tandem.backend.generation.sampling import SamplingParams

    seed = params.seed if params.seed is not None else int.from_bytes(np.random.bytes(7), "little")
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        repetition_penalty=params.repetition_penalty,
        grammar=params.grammar,
        grammar_start=params.grammar_start,
        stop_token_ids=params.stop_token_ids,
    )
