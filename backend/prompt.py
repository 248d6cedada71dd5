"""The one place request tensors become domain values: the prompt and the sampling parameters.

Every entry point (the Triton models, a router, the HTTP client path) calls these before allocating
anything for a request, so a malformed request costs a check, never KV pages. Each problem becomes
`InvalidInput` naming the input and what is wrong with it; nothing is coerced silently (an FP32
prompt or an INT64 MAX_TOKENS is refused, not cast), because a silent cast hides client bugs that
later surface as garbled audio.

The prompt's id scan is native (`tandem.csrc`, GIL released) because prompts are 1000+ rows and this
runs on the scheduler's admission path; the scalars are a handful of values and stay in Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from tandem.backend.errors import InvalidInput
from tandem.backend.generation.grammar import Grammar
from tandem.backend.model.config import ModelConfig
from tandem.backend.settings import Limits
from tandem.csrc import pack_rows, validate_rows
from tandem.wire import contract as wire
from tandem.wire.contract import triton_name

# The request's input names, the contract's (`wire/contract.py`), for callers that build input maps.
PROMPT, TEXT, VOICE = wire.PROMPT.name, wire.TEXT.name, wire.VOICE.name
MAX_TOKENS, TEMPERATURE, TOP_P, TOP_K = (
    t.name for t in (wire.MAX_TOKENS, wire.TEMPERATURE, wire.TOP_P, wire.TOP_K)
)
SEED, VOICE_ID, REPETITION_PENALTY = wire.SEED.name, wire.VOICE_ID.name, wire.REPETITION_PENALTY.name

# Bounds and defaults of the sampling inputs. They are part of the request contract (clients rely
# on them), not deployment tunables, so they live here rather than in `Limits`.
MAX_TEMPERATURE = 10.0
MAX_REPETITION_PENALTY = 10.0
MAX_VOICE_ID_BYTES = 256
MAX_VOICE_BYTES = 256
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0  # 0 disables top-k
DEFAULT_REPETITION_PENALTY = 1.0  # 1 disables it
DEFAULT_VOICE_ID = ""  # the model's default voice


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# --- the prompt -------------------------------------------------------------------------------------


def check_prompt(arr: np.ndarray, cfg: ModelConfig, limits: Limits) -> np.ndarray:
    """Validate a PROMPT tensor (`wire.PROMPT`: [N, row_width] INT64) and return it C-contiguous.

    Returns `arr` itself when it is already C-contiguous, else one contiguous copy; the caller owns
    the result and may hand it to the engine without further checks.

    Raises:
        InvalidInput: wrong dtype, not 2-D, wrong width, 0 or more than `limits.max_prompt_rows`
            rows, or an id outside [0, cfg.vocab_size) (CSM's rows: outside its column's range,
            `ModelConfig.column_vocab`, with -1 for an absent column).
    """
    name, dtype = wire.PROMPT.name, wire.PROMPT.dtype
    if not isinstance(arr, np.ndarray):
        raise InvalidInput(f"{name} must be an {dtype.triton} tensor, got {type(arr).__name__}")
    if arr.dtype != dtype.numpy:
        raise InvalidInput(f"{name} must be {dtype.triton}, got {triton_name(arr.dtype)}")
    if arr.ndim != 2:
        raise InvalidInput(f"{name} must have shape [rows, {cfg.row_width}], got {_shape(arr.shape)}")
    try:
        validate_rows(
            arr, cfg.row_width, cfg.vocab_size, limits.max_prompt_rows, cfg.column_vocab, cfg.min_id
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc
    return np.ascontiguousarray(arr)


def pack_prompt(rows: Sequence[Sequence[int]], cfg: ModelConfig, limits: Limits) -> np.ndarray:
    """Pack a JSON-style prompt (a list of rows of ints) into a new C-contiguous int64 [N, W] array.

    For clients that send lists (a router, the HTTP path); same checks and messages as
    `check_prompt`, plus ragged rows and non-integer ids.

    Raises:
        InvalidInput: naming the first problem, e.g. ``PROMPT row 7 has 3 ids; expected 4``.
    """
    try:
        return pack_rows(
            rows, cfg.row_width, cfg.vocab_size, limits.max_prompt_rows, cfg.column_vocab, cfg.min_id
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from exc


# --- scalar parameters ------------------------------------------------------------------------------


def _scalar(name: str, value: object, dtype: np.dtype) -> Any:
    """The single element of a [1]-shaped tensor of exactly `dtype` (BYTES: object or S arrays)."""
    if not isinstance(value, np.ndarray):
        raise InvalidInput(f"{name} must be a tensor, got {type(value).__name__}")
    want = triton_name(dtype)
    if want == wire.BYTES.triton:
        if value.dtype.kind not in "OS":
            raise InvalidInput(f"{name} must be {want}, got {triton_name(value.dtype)}")
    elif value.dtype != dtype:
        raise InvalidInput(f"{name} must be {want}, got {triton_name(value.dtype)}")
    if value.shape != (1,):
        raise InvalidInput(f"{name} must have shape [1], got {_shape(value.shape)}")
    return value[0]  # a numpy scalar, or for object arrays the element itself (bytes for Triton BYTES)


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _interval(lo: float | None, hi: float | None, lo_open: bool) -> str:
    left = "(" if lo_open or lo is None else "["
    right = ")" if hi is None else "]"
    lo_s = "-inf" if lo is None else _number(lo)
    hi_s = "inf" if hi is None else _number(hi)
    return f"{left}{lo_s}, {hi_s}{right}"


@overload
def check_int(
    name: str,
    value: np.ndarray | None,
    dtype: np.dtype,
    default: int,
    lo: int | None = None,
    hi: int | None = None,
) -> int: ...
@overload
def check_int(
    name: str,
    value: np.ndarray | None,
    dtype: np.dtype,
    default: None,
    lo: int | None = None,
    hi: int | None = None,
) -> int | None: ...
def check_int(
    name: str,
    value: np.ndarray | None,
    dtype: np.dtype,
    default: int | None,
    lo: int | None = None,
    hi: int | None = None,
) -> int | None:
    """An integer input of exactly `dtype` and shape [1], in [lo, hi] (None: unbounded).

    Returns `default` when the input is absent (`value` is None), else a plain Python int.
    """
    if value is None:
        return default
    v = int(_scalar(name, value, dtype))
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidInput(f"{name} = {v} is outside {_interval(lo, hi, False)}")
    return v


def check_float(
    name: str,
    value: np.ndarray | None,
    default: float,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    allow_nan: bool = False,
) -> float:
    """An FP32 input of shape [1] in [lo, hi] (or (lo, hi] with `lo_open`); None bounds are open.

    With `allow_nan` False, NaN and ±inf are refused: a NaN temperature would silently turn every
    logit into NaN downstream. With it True they are returned as they are and only finite values are
    range-checked. Returns `default` when absent, else a plain Python float.
    """
    if value is None:
        return default
    raw = _scalar(name, value, wire.FP32.numpy)
    v = float(raw)
    if not math.isfinite(v):
        if allow_nan:
            return v
        raise InvalidInput(f"{name} = {raw} is not a finite number")
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise InvalidInput(f"{name} = {raw} is outside {_interval(lo, hi, lo_open)}")
    return v


def check_text(name: str, value: np.ndarray | None, default: str, max_bytes: int) -> str:
    """A BYTES input of shape [1] holding at most `max_bytes` bytes of UTF-8; returns the decoded str."""
    if value is None:
        return default
    item: object = _scalar(name, value, wire.BYTES.numpy)
    if isinstance(item, str):  # some clients hand the python backend str objects for BYTES
        item = item.encode("utf-8")
    if not isinstance(item, bytes):
        raise InvalidInput(
            f"{name} must be {wire.BYTES.triton}, got an element of type {type(item).__name__}"
        )
    if len(item) > max_bytes:
        raise InvalidInput(f"{name} is {len(item)} bytes; the limit is {max_bytes}")
    try:
        return item.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{name} is not valid UTF-8 (byte {exc.start})") from exc


@dataclass(frozen=True)
class TextRequest:
    """A request's TEXT and VOICE after validation: `text` has a non-blank character, `voice` is ""
    for none. `backend/text/frontend.py` turns it into prompt rows."""

    text: str
    voice: str


def check_text_request(
    prompt: np.ndarray | None,
    text: np.ndarray | None,
    voice: np.ndarray | None,
    max_text_bytes: int | None,
) -> TextRequest | None:
    """Which prompt a request carries: None for PROMPT (checked by `check_prompt`), else its text.

    A request carries exactly one of PROMPT and TEXT; VOICE goes with TEXT only (a PROMPT's rows
    already hold their voice). `max_text_bytes` None means the model takes no TEXT (it has no
    tokenizer). Raises `InvalidInput` naming the problem: both or neither, VOICE without TEXT, TEXT
    on a model without a tokenizer, TEXT or VOICE not one BYTES element, not UTF-8, over its limit,
    or TEXT empty or blank.
    """
    if prompt is not None and text is not None:
        raise InvalidInput("a request carries exactly one of PROMPT and TEXT, not both")
    if prompt is None and text is None:
        if voice is not None:
            raise InvalidInput("VOICE needs TEXT, and the request has no TEXT (nor a PROMPT)")
        raise InvalidInput("a request carries exactly one of PROMPT and TEXT; it has neither")
    if text is None:
        if voice is not None:
            raise InvalidInput("VOICE goes with TEXT only; a PROMPT's rows already hold their voice")
        return None
    if max_text_bytes is None:
        raise InvalidInput("TEXT is not accepted: this model has no tokenizer (tandem.frontend.tokenizer)")
    value = check_text(wire.TEXT.name, text, "", max_text_bytes)
    if not value.strip():
        raise InvalidInput("TEXT is empty" if not value else "TEXT is blank (only whitespace)")
    return TextRequest(value, check_text(wire.VOICE.name, voice, "", MAX_VOICE_BYTES))


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that names no sampling input gets, and the model's stream policy (grammar,
    stop ids). The request contract's values here; a checkpoint's from `backend/text/defaults.py`."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = DEFAULT_TOP_K
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    grammar: Grammar = Grammar.NONE
    stop_token_ids: tuple[int, ...] = ()


CONTRACT_DEFAULTS = GenerationDefaults()  # a model without a checkpoint's generation config


@dataclass(frozen=True)
class RequestParams:
    """A request's generation parameters after validation; plain Python values only."""

    max_new_rows: int
    temperature: float  # 0 means greedy
    top_p: float  # in (0, 1]; 1 disables nucleus filtering
    top_k: int  # 0 disables top-k
    seed: int | None  # None: the engine picks one
    voice_id: str  # "" means the model's default voice
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY  # in (0, 10]; 1 disables it
    grammar: Grammar = Grammar.NONE  # the model's, not the request's
    grammar_start: int = 0  # the prompt's length: position of the first generated row
    stop_token_ids: tuple[int, ...] = ()  # the model's


def parse_params(
    inputs: Mapping[str, np.ndarray | None],
    cfg: ModelConfig,
    limits: Limits,
    defaults: GenerationDefaults = CONTRACT_DEFAULTS,
) -> RequestParams:
    """Validate every optional scalar input; an absent (or None) input takes its default from
    `defaults` (the model's generation defaults), as do the grammar and stop ids.

    Inputs not named here (PROMPT among them) are ignored; `grammar_start` is left 0 for the caller,
    who knows the prompt. Raises `InvalidInput` for the first bad input, in the order of
    `RequestParams`' fields.
    """

    def given(spec: wire.TensorSpec) -> tuple[str, np.ndarray | None]:
        return spec.name, inputs.get(spec.name)

    return RequestParams(
        max_new_rows=check_int(
            *given(wire.MAX_TOKENS),
            wire.MAX_TOKENS.dtype.numpy,
            limits.default_new_rows,
            1,
            limits.max_new_rows,
        ),
        temperature=check_float(*given(wire.TEMPERATURE), defaults.temperature, 0.0, MAX_TEMPERATURE),
        top_p=check_float(*given(wire.TOP_P), defaults.top_p, 0.0, 1.0, lo_open=True),
        top_k=check_int(*given(wire.TOP_K), wire.TOP_K.dtype.numpy, defaults.top_k, 0, cfg.vocab_size),
        seed=check_int(*given(wire.SEED), wire.SEED.dtype.numpy, None),
        voice_id=check_text(*given(wire.VOICE_ID), DEFAULT_VOICE_ID, MAX_VOICE_ID_BYTES),
        repetition_penalty=check_float(
            *given(wire.REPETITION_PENALTY),
            defaults.repetition_penalty,
            0.0,
            MAX_REPETITION_PENALTY,
            lo_open=True,
        ),
        grammar=defaults.grammar,
        stop_token_ids=defaults.stop_token_ids,
    )
