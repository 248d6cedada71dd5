"""Hypothesis strategies for whole requests to `tts` / `tts_mono`, and the verdict each should get.

Table-driven from what the server publishes: `Contract.read` takes the model's inputs from
`get_model_metadata` (name, datatype, dims) and `get_model_config` (optional or not), and the engine's
limits from the `tandem.*` parameters of the engine that reads the request (`prefill` for `tts`).
Inputs with a known name (`KNOWN`) get strategies that straddle their exact bounds in
`backend/prompt.py` and a verdict (valid or which input is bad); an input the table does not know
(one added since, e.g. TEXT) gets a well-typed strategy by datatype and the verdict "either": a
clean stream or an error naming that input.

On top of each input's own value a tensor may be corrupted on the wire (another datatype, another
rank, a negative or huge dimension, raw bytes of the wrong length, broken BYTES length prefixes),
inputs may be missing, duplicated or unknown, and the sequence flags may be wrong. A sequence that
opens without ending is never drawn: it holds one of the model's sequence slots for the idle
timeout (docs/abuse.md, finding 1; `test_abuse.py` tests that bound on its own).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tests.support.wire import NUMPY, WireTensor

VALID, INVALID, EITHER = "valid", "invalid", "either"
SEQUENCE = "<sequence>"  # pseudo input name: the error is about the stream id or its flags
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool


@dataclass(frozen=True)
class Contract:
    """What a client can learn from the server, plus the engine limits its config sets."""

    model: str
    inputs: tuple[InputSpec, ...]
    row_width: int
    vocab_size: int
    samples_per_row: int
    max_prompt_rows: int
    max_new_rows: int
    default_new_rows: int

    @staticmethod
    def read(client: Any, model: str) -> Contract:
        from tandem.backend.settings import parse_settings, triton_parameters

        meta = client.get_model_metadata(model, as_json=True)
        cfg = client.get_model_config(model, as_json=True)["config"]
        optional = {i["name"]: bool(i.get("optional", False)) for i in cfg.get("input", [])}
        inputs = tuple(
            InputSpec(
                i["name"], i["datatype"], tuple(int(d) for d in i["shape"]), optional.get(i["name"], False)
            )
            for i in meta["inputs"]
        )
        pub = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
        engine = "prefill" if cfg.get("platform") == "ensemble" else model
        ecfg = client.get_model_config(engine, as_json=True)["config"]
        limits = parse_settings(triton_parameters(ecfg)).limits
        return Contract(
            model=model,
            inputs=inputs,
            row_width=int(pub["row_width"]),
            vocab_size=int(pub["vocab_size"]),
            samples_per_row=int(pub["sample_rate"]) // int(pub["rows_per_second"]),
            max_prompt_rows=limits.max_prompt_rows,
            max_new_rows=limits.max_new_rows,
            default_new_rows=limits.default_new_rows,
        )


@dataclass(frozen=True)
class Value:
    """One input's tensor and what the engine's checks make of it."""

    tensor: WireTensor
    verdict: str  # VALID, INVALID or EITHER
    scalar: Any = None  # the decoded value when VALID (MAX_TOKENS: the row count to expect)
    note: str = ""  # how it was made, for the report of a failing case


@dataclass(frozen=True)
class Case:
    model: str
    tensors: tuple[WireTensor, ...]
    sequence_id: int | str
    start: bool
    end: bool
    verdict: str
    culprits: frozenset[str]  # inputs (or SEQUENCE) an error may name; empty when VALID
    rows: int  # rows a valid stream must carry
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        shapes = ", ".join(f"{t.name}:{t.datatype}{list(t.shape)}({len(t.raw)}B)" for t in self.tensors)
        return (
            f"{self.model} seq={self.sequence_id!r} start={self.start} end={self.end} [{shapes}] "
            f"-> {self.verdict} {sorted(self.culprits)} {'; '.join(self.notes)}"
        )


# --- scalars ---------------------------------------------------------------------------------------

_OTHER_TYPES = ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64")


def _int_values(lo: int, hi: int, bits: tuple[int, int]) -> st.SearchStrategy[int]:
    edges = sorted({lo - 1, lo, lo + 1, hi - 1, hi, hi + 1, 0, -1, bits[0], bits[1]})
    return st.one_of(
        st.sampled_from([e for e in edges if bits[0] <= e <= bits[1]]),
        st.integers(lo, min(hi, lo + 64)),
        st.integers(*bits),
    )


def _float_values(lo: float, hi: float) -> st.SearchStrategy[float]:
    edges = [lo, hi, 0.0, -0.0, 1.0, -1.0, math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf)]
    edges += [math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-45]
    return st.one_of(
        st.sampled_from(edges),
        st.floats(lo, hi, width=32),
        st.floats(width=32, allow_nan=True, allow_infinity=True),
    )


def _scalar(
    name: str, triton: str, values: st.SearchStrategy[Any], ok: Callable[[Any], bool]
) -> st.SearchStrategy[Value]:
    """A [1] tensor of `triton` holding one drawn value; `ok(value)` says whether the engine takes it."""
    np_type = NUMPY[triton]

    def build(v: Any) -> Value:
        arr = np.array([v], dtype=np_type)
        decoded = arr[0].item()
        good = ok(decoded)
        return Value(WireTensor.of(name, arr), VALID if good else INVALID, decoded, f"{name}={decoded!r}")

    return values.map(build)


def _retyped(name: str, want: str) -> st.SearchStrategy[Value]:
    """A well-formed [1] tensor of any other datatype: Triton refuses it before any engine sees it."""

    def build(t: str, seed: int) -> Value:
        arr = np.random.default_rng(seed).integers(0, 2, size=(1,)).astype(NUMPY[t])
        return Value(WireTensor.of(name, arr), INVALID, note=f"{name} as {t}")

    return st.builds(build, st.sampled_from([t for t in _OTHER_TYPES if t != want]), st.integers(0, 2**16))


@dataclass(frozen=True)
class Table:
    """An input's strategies: `valid` draws only values the engine takes, `any` straddles the bounds."""

    valid: st.SearchStrategy[Value]
    any: st.SearchStrategy[Value]


def _int_input(name: str, triton: str, lo: int | None, hi: int | None) -> Table:
    bits = INT32 if triton == "INT32" else INT64
    lo_, hi_ = lo if lo is not None else bits[0], hi if hi is not None else bits[1]

    def ok(v: int) -> bool:
        return lo_ <= v <= hi_

    return Table(
        _scalar(name, triton, st.integers(lo_, hi_), ok),
        st.one_of(*[_scalar(name, triton, _int_values(lo_, hi_, bits), ok)] * 3, _retyped(name, triton)),
    )


def _float_input(name: str, lo: float, hi: float, lo_open: bool) -> Table:
    def ok(v: float) -> bool:
        return math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi

    inside = st.floats(lo, hi, width=32, exclude_min=lo_open)
    return Table(
        _scalar(name, "FP32", st.one_of(inside, st.sampled_from([hi] if lo_open else [lo, hi])), ok),
        st.one_of(*[_scalar(name, "FP32", _float_values(lo, hi), ok)] * 3, _retyped(name, "FP32")),
    )


def _bytes_input(name: str, max_bytes: int) -> Table:
    def build(b: bytes) -> Value:
        good = len(b) <= max_bytes
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            good = False
        arr = np.array([b], dtype=np.object_)
        return Value(WireTensor.of(name, arr), VALID if good else INVALID, b, f"{name}={b[:24]!r}..{len(b)}B")

    texts = st.text(max_size=80).map(lambda s: s.encode("utf-8"))
    edges = st.sampled_from([b"", b"\x00", b"a\x00b", b"\xff", b"\xc3", b"\xed\xa0\x80", b"x" * max_bytes])
    long = st.integers(max_bytes - 2, max_bytes + 64).map(lambda n: ("\u00e9" * n).encode()[:n])
    fits = st.text(max_size=max_bytes // 4).map(lambda s: s.encode("utf-8"))
    return Table(
        st.one_of(fits, st.sampled_from([b"", b"a\x00b", b"x" * max_bytes])).map(build),
        st.one_of(st.binary(max_size=300), texts, edges, long).map(build),
    )


# --- the prompt ------------------------------------------------------------------------------------


def _prompt_input(c: Contract) -> Table:
    w, v, limit = c.row_width, c.vocab_size, c.max_prompt_rows
    rows = st.one_of(st.integers(1, 40), st.sampled_from([1, limit - 1, limit, limit + 1]), st.just(0))
    width = st.one_of(st.just(w), st.sampled_from([0, 1, w - 1, w + 1, 2 * w]))
    bad_ids = st.lists(st.sampled_from([v, v + 1, -1, INT64[0], INT64[1], 2**31]), max_size=2)

    def build(n: int, wd: int, seed: int, bad: list[int]) -> Value:
        arr = np.random.default_rng(seed).integers(0, v, size=(n, wd), dtype=np.int64)
        for k, x in enumerate(bad):
            if arr.size:
                arr.flat[(seed + 7919 * k) % arr.size] = x
        good = 1 <= n <= limit and wd == w and not (bad and arr.size)
        return Value(
            WireTensor.of("PROMPT", arr), VALID if good else INVALID, n, f"PROMPT[{n},{wd}] bad={bad}"
        )

    def other_rank(seed: int, shape: list[int]) -> Value:
        arr = np.random.default_rng(seed).integers(0, v, size=tuple(shape), dtype=np.int64)
        return Value(WireTensor.of("PROMPT", arr), INVALID, note=f"PROMPT shape {shape}")

    def other_type(t: str, n: int) -> Value:
        arr = np.zeros((n, w), dtype=NUMPY[t])
        return Value(WireTensor.of("PROMPT", arr), INVALID, note=f"PROMPT as {t}")

    fit = st.one_of(st.integers(1, 60), st.just(limit))
    return Table(
        st.builds(build, fit, st.just(w), st.integers(0, 2**32), st.just([])),
        st.one_of(
            st.builds(build, rows, width, st.integers(0, 2**32), bad_ids),
            st.builds(
                other_rank,
                st.integers(0, 2**32),
                st.one_of(
                    st.lists(st.integers(0, 6), max_size=1),
                    st.lists(st.integers(0, 4), min_size=3, max_size=4),
                ),
            ),
            st.builds(
                other_type, st.sampled_from([t for t in _OTHER_TYPES if t != "INT64"]), st.integers(0, 8)
            ),
        ),
    )


# --- the table -------------------------------------------------------------------------------------


def known(c: Contract) -> dict[str, Table]:
    """Strategies for every input whose bounds this table knows (backend/prompt.py). Hypothesis
    favours boundaries, so a valid stream is often one of `c.max_new_rows` rows: keep that limit
    small on the fuzz server (test_fuzz.py)."""
    from tandem.backend import prompt as p

    return {
        p.PROMPT: _prompt_input(c),
        p.MAX_TOKENS: _int_input(p.MAX_TOKENS, "INT32", 1, c.max_new_rows),
        p.TEMPERATURE: _float_input(p.TEMPERATURE, 0.0, p.MAX_TEMPERATURE, lo_open=False),
        p.TOP_P: _float_input(p.TOP_P, 0.0, 1.0, lo_open=True),
        p.TOP_K: _int_input(p.TOP_K, "INT32", 0, c.vocab_size),
        p.SEED: _int_input(p.SEED, "INT64", None, None),
        p.VOICE_ID: _bytes_input(p.VOICE_ID, p.MAX_VOICE_ID_BYTES),
    }


def generic(spec: InputSpec) -> Table:
    """An input the table does not know: well-typed, of its declared dims (-1 -> 1..4); the verdict
    is EITHER even in a "valid" draw (the table cannot know what the engine takes)."""

    def build(seed: int, sizes: list[int], blob: bytes) -> Value:
        shape = tuple(sizes[i] if d < 0 else d for i, d in enumerate(spec.dims))
        if spec.datatype == "BYTES":
            arr = np.array([blob] * int(np.prod(shape, dtype=np.int64)), dtype=np.object_).reshape(shape)
        else:
            dt = NUMPY[spec.datatype]
            raw = np.random.default_rng(seed).bytes(int(np.prod(shape, dtype=np.int64)) * dt.itemsize)
            arr = np.frombuffer(raw, dtype=dt).reshape(shape)
        return Value(WireTensor.of(spec.name, arr), EITHER, note=f"{spec.name} (untabled)")

    sizes = st.lists(st.integers(1, 4), min_size=len(spec.dims), max_size=len(spec.dims))
    any_ = st.builds(build, st.integers(0, 2**32), sizes, st.binary(max_size=64))
    return Table(any_, any_)


# --- wire-level corruption -------------------------------------------------------------------------


def _corrupt(draw: st.DrawFn, t: WireTensor) -> tuple[WireTensor, str]:
    kind = draw(st.sampled_from(["datatype", "rank", "negative", "huge", "short", "long", "prefix"]))
    if kind == "datatype":
        other = draw(
            st.sampled_from([x for x in (*_OTHER_TYPES, "BYTES", "BF16", "", "INT128") if x != t.datatype])
        )
        return WireTensor(t.name, other, t.shape, t.raw), f"{t.name} datatype->{other!r}"
    if kind == "rank":
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
        if shape == t.shape:  # not a corruption: one more axis is
            shape = (*shape, 1)
        return WireTensor(t.name, t.datatype, shape, t.raw), f"{t.name} shape->{list(shape)}"
    if kind == "negative":
        shape = (*t.shape[:-1], draw(st.integers(-(2**40), -1))) if t.shape else (-1,)
        return WireTensor(t.name, t.datatype, shape, t.raw), f"{t.name} shape->{list(shape)}"
    if kind == "huge":
        shape = (draw(st.sampled_from([2**31, 2**40, 2**62])), *t.shape[1:])
        return WireTensor(t.name, t.datatype, shape, t.raw), f"{t.name} shape->{list(shape)}"
    if kind == "prefix" and t.datatype == "BYTES":
        fake = draw(st.sampled_from([len(t.raw) + 1, 2**31, 2**32 - 1, 0]))
        raw = struct.pack("<I", fake) + t.raw[4:]
        return WireTensor(t.name, t.datatype, t.shape, raw), f"{t.name} length prefix->{fake}"
    if kind in ("short", "prefix") and t.raw:
        cut = draw(st.integers(0, len(t.raw) - 1))
        return WireTensor(t.name, t.datatype, t.shape, t.raw[:cut]), f"{t.name} raw cut to {cut}B"
    extra = draw(st.binary(min_size=1, max_size=16))
    return WireTensor(t.name, t.datatype, t.shape, t.raw + extra), f"{t.name} raw +{len(extra)}B"


# --- whole requests --------------------------------------------------------------------------------


def _sequence(draw: st.DrawFn, clean: bool) -> tuple[int | str, bool, bool, bool]:
    """(id, start, end, valid). Never (id, start, not end): see the module docstring."""
    sid = draw(st.one_of(st.integers(1, INT64[1]), st.text("abcdef0123456789", min_size=1, max_size=12)))
    kind = "one-shot" if clean else draw(st.sampled_from(["one-shot"] * 6 + ["no id", "end only", "neither"]))
    if kind == "one-shot":
        return sid, True, True, True
    if kind == "no id":
        return draw(st.sampled_from([0, ""])), draw(st.booleans()), draw(st.booleans()), False
    return sid, False, kind == "end only", False


@st.composite
def cases(draw: st.DrawFn, c: Contract, table: Mapping[str, Table]) -> Case:
    """One request to `c.model` and its verdict (see the module docstring). Four draws in ten are
    clean (every input from its valid strategy, nothing corrupted, a one-shot stream id), so valid
    streams are a real share of the run; in the rest each input draws from its straddling strategy
    one time in three (so single faults, which reach the engine's own checks, are common)."""
    clean = draw(st.integers(0, 9)) < 4
    tensors: list[WireTensor] = []
    bad: set[str] = set()
    unsure: set[str] = set()
    notes: list[str] = []
    rows = c.default_new_rows
    for spec in c.inputs:
        # PROMPT is optional in the config only because TEXT may stand in for it: a request carries
        # exactly one of the two (docs/protocol.md), settled after the loop.
        required = not spec.optional or spec.name == "PROMPT"
        present = draw(st.booleans()) if not required else (clean or draw(st.integers(0, 19)) > 0)
        if not present:
            if required:
                bad.add(spec.name)
                notes.append(f"no {spec.name}")
            continue
        strategies = table[spec.name] if spec.name in table else generic(spec)
        faulty = not clean and draw(st.integers(0, 2)) == 0  # one fault at a time, mostly
        value = draw(strategies.any if faulty else strategies.valid)
        tensor = value.tensor
        if not clean and draw(st.integers(0, 11)) == 0:
            tensor, how = _corrupt(draw, tensor)
            notes.append(how)
            bad.add(spec.name)
        elif value.verdict == INVALID:
            bad.add(spec.name)
        elif value.verdict == EITHER:
            unsure.add(spec.name)
        if value.note:
            notes.append(value.note)
        if spec.name == "MAX_TOKENS" and value.verdict == VALID:
            rows = int(value.scalar)
        tensors.append(tensor)
    names = {tensor.name for tensor in tensors}
    if "TEXT" in names and "PROMPT" in names:
        bad.add("TEXT")
        notes.append("PROMPT and TEXT")
    elif "TEXT" in names and "PROMPT" in bad and "no PROMPT" in notes:
        bad.discard("PROMPT")  # TEXT stands in for the prompt; whether it is valid text is unsure
        unsure.add("TEXT")
    extra = 2 if clean else draw(st.integers(0, 15))
    if extra == 0 and tensors:
        tensors.append(tensors[0])
        bad.add(tensors[0].name)
        notes.append(f"{tensors[0].name} twice")
    elif extra == 1:
        name = draw(st.sampled_from(["", "prompt", "EXTRA", "PROMPT ", "\u00e9", "X" * 300]))
        tensors.append(WireTensor.of(name, np.array([1], dtype=np.int32)))
        bad.add(name)
        notes.append(f"unknown input {name[:12]!r}")
    tensors = draw(st.permutations(tensors))
    sid, start, end, seq_ok = _sequence(draw, clean)
    if not seq_ok:
        bad.add(SEQUENCE)
        notes.append("sequence flags")
    verdict = INVALID if bad else (EITHER if unsure else VALID)
    return Case(
        c.model, tuple(tensors), sid, start, end, verdict, frozenset(bad | unsure), rows, tuple(notes)
    )
