"""Each served model's inputs and outputs: name, dtype (Triton's and numpy's) and shape rule.

Who reads it: `backend/prompt.py` checks a request's tensors against these dtypes and shapes;
`serving/triton_io.py` reads requests and writes responses by these names; `serving/repository.py`
writes every model's `input [...]` and `output [...]` of config.pbtxt from `MODELS` (the checked-in
files are that rendering at the tiny preset's widths, tested); `gateway/client.py` and
`gateway/stream.py` build requests from it. A name here is the name on the wire: a client sends it,
Triton routes it, an ensemble maps it.

Shapes: a model's rows (`Shape.ROWS`, `[-1, W]`) and codec frames (`Shape.FRAMES`, `[-1, K]`) take the
served model's widths (`Widths`), fixed when the repository is rendered; one variable dimension per
tensor at most (Triton 2.51 checks a request's byte size only then: `serving/triton_io.check_dims`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum

import numpy as np


@dataclass(frozen=True)
class DType:
    """A tensor's element type as Triton names it (`triton`: what a client's `InferInput` says) and
    as numpy holds it (`numpy`: what `as_numpy()` gives; BYTES are object arrays of bytes)."""

    triton: str
    numpy: np.dtype

    @property
    def config(self) -> str:
        """The config.pbtxt `data_type` (BYTES is `TYPE_STRING` there)."""
        return "TYPE_STRING" if self.triton == "BYTES" else f"TYPE_{self.triton}"


INT32 = DType("INT32", np.dtype(np.int32))
INT64 = DType("INT64", np.dtype(np.int64))
FP32 = DType("FP32", np.dtype(np.float32))
BYTES = DType("BYTES", np.dtype(np.object_))

_TRITON_NAMES = {
    ("b", 1): "BOOL",
    ("u", 1): "UINT8",
    ("u", 2): "UINT16",
    ("u", 4): "UINT32",
    ("u", 8): "UINT64",
    ("i", 1): "INT8",
    ("i", 2): "INT16",
    ("i", 4): "INT32",
    ("i", 8): "INT64",
    ("f", 2): "FP16",
    ("f", 4): "FP32",
    ("f", 8): "FP64",
}


def triton_name(dtype: np.dtype) -> str:
    """The Triton name of any numpy dtype, so a message speaks the client's vocabulary (FP32, not
    float32); object and byte-string arrays are BYTES."""
    if dtype.kind in "OS":
        return BYTES.triton
    name = _TRITON_NAMES.get((dtype.kind, dtype.itemsize), str(dtype))
    if not dtype.isnative:
        name += " (non-native byte order)"
    return name


@dataclass(frozen=True)
class Widths:
    """The served model's widths: ids per row (W) and codes per codec frame (K)."""

    row_width: int
    frame_width: int


class Shape(Enum):
    ONE = "one"  # [1]: one element
    ROWS = "rows"  # [-1, W]: rows of the model's width
    FRAMES = "frames"  # [-1, K]: codec frames of K codes
    SAMPLES = "samples"  # [-1]: PCM samples
    WINDOW = "window"  # [3]: a chunk's codec window (first_frame, emit_from, emit_to)

    def dims(self, widths: Widths) -> list[int]:
        if self is Shape.ROWS:
            return [-1, widths.row_width]
        if self is Shape.FRAMES:
            return [-1, widths.frame_width]
        return {Shape.ONE: [1], Shape.SAMPLES: [-1], Shape.WINDOW: [3]}[self]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: DType
    shape: Shape
    optional: bool = False

    def config_line(self, widths: Widths) -> str:
        """This tensor as one config.pbtxt entry."""
        dims = ", ".join(str(d) for d in self.shape.dims(widths))
        optional = " optional: true" if self.optional else ""
        return f'{{ name: "{self.name}" data_type: {self.dtype.config} dims: [ {dims} ]{optional} }}'


def _optional(*specs: TensorSpec) -> tuple[TensorSpec, ...]:
    return tuple(dataclasses.replace(s, optional=True) for s in specs)


# --- the client's contract (`tts`, `tts_mono`) -----------------------------------------------------
PROMPT = TensorSpec("PROMPT", INT64, Shape.ROWS)  # prompt rows; exactly one of PROMPT and TEXT
TEXT = TensorSpec("TEXT", BYTES, Shape.ONE)  # UTF-8 text to speak
VOICE = TensorSpec("VOICE", BYTES, Shape.ONE)  # goes with TEXT: a built-in or registered voice
MAX_TOKENS = TensorSpec("MAX_TOKENS", INT32, Shape.ONE)
TEMPERATURE = TensorSpec("TEMPERATURE", FP32, Shape.ONE)
TOP_P = TensorSpec("TOP_P", FP32, Shape.ONE)
TOP_K = TensorSpec("TOP_K", INT32, Shape.ONE)
SEED = TensorSpec("SEED", INT64, Shape.ONE)
VOICE_ID = TensorSpec("VOICE_ID", BYTES, Shape.ONE)  # the affinity and metrics label
REPETITION_PENALTY = TensorSpec("REPETITION_PENALTY", FP32, Shape.ONE)
# The optional sampling inputs, in the order `backend/prompt.py` checks them.
SAMPLING = (MAX_TOKENS, TEMPERATURE, TOP_P, TOP_K, SEED, VOICE_ID, REPETITION_PENALTY)
TOKENS = TensorSpec("TOKENS", INT64, Shape.ROWS)  # the response's generated rows
AUDIO = TensorSpec("AUDIO", FP32, Shape.SAMPLES)  # the response's PCM
TIMINGS = TensorSpec("TIMINGS", BYTES, Shape.ONE)  # JSON stamps (backend/timing.py)

# --- the steps of `tts` ------------------------------------------------------------------------------
ROWS = TensorSpec("ROWS", INT64, Shape.ROWS)  # frontend: the prompt rows
HANDOFF = TensorSpec("HANDOFF", BYTES, Shape.ONE)  # P -> D: the ticket (backend/engines/handoff.py)
CANCEL = TensorSpec("CANCEL", INT64, Shape.ONE)  # a `tts` stream id, sent to `decode` to cancel it
CODES = TensorSpec("CODES", INT64, Shape.FRAMES)  # D -> vocoder: the chunk's frames with context
WINDOW = TensorSpec("WINDOW", INT64, Shape.WINDOW)  # D -> vocoder: which of them to emit
TOKENS_OUT = TensorSpec("TOKENS_OUT", INT64, Shape.ROWS)  # the vocoder's TOKENS, passed on
TIMINGS_OUT = TensorSpec("TIMINGS_OUT", BYTES, Shape.ONE)  # the vocoder's TIMINGS, first_audio stamped

# --- `voices` (backend/voices/request.py) --------------------------------------------------------------
ACTION = TensorSpec("ACTION", BYTES, Shape.ONE)  # register, list, delete
NAME = TensorSpec("NAME", BYTES, Shape.ONE)
TRANSCRIPT = TensorSpec("TRANSCRIPT", BYTES, Shape.ONE)
REFERENCE = TensorSpec("AUDIO", BYTES, Shape.ONE)  # the reference recording's file, whole
RESULT = TensorSpec("RESULT", BYTES, Shape.ONE)  # the answer as JSON


@dataclass(frozen=True)
class ModelSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def tensors(self) -> Iterator[TensorSpec]:
        yield from self.inputs
        yield from self.outputs

    def names(self, shape: Shape) -> tuple[str, ...]:
        """The names of this model's tensors of `shape` (inputs, then outputs)."""
        return tuple(dict.fromkeys(t.name for t in self.tensors() if t.shape is shape))


_SPEECH_INPUTS = (*_optional(PROMPT, TEXT, VOICE), *_optional(*SAMPLING))
_SPEECH_OUTPUTS = (TOKENS, AUDIO, TIMINGS)

TTS = ModelSpec("tts", _SPEECH_INPUTS, _SPEECH_OUTPUTS)
TTS_MONO = ModelSpec("tts_mono", _SPEECH_INPUTS, _SPEECH_OUTPUTS)
FRONTEND = ModelSpec("frontend", _optional(PROMPT, TEXT, VOICE), (ROWS,))
PREFILL = ModelSpec("prefill", (PROMPT, *_optional(*SAMPLING)), (HANDOFF,))
DECODE = ModelSpec("decode", _optional(HANDOFF, CANCEL), (TOKENS, CODES, WINDOW, TIMINGS))
VOCODER = ModelSpec("vocoder", (TOKENS, CODES, WINDOW, TIMINGS), (TOKENS_OUT, AUDIO, TIMINGS_OUT))
VOICES = ModelSpec("voices", _optional(ACTION, NAME, TRANSCRIPT, REFERENCE), (RESULT,))

MODELS = {m.name: m for m in (FRONTEND, PREFILL, DECODE, VOCODER, TTS, TTS_MONO, VOICES)}
