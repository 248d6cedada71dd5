"""Prompt and request-parameter validation: every bad input gets an exact, actionable message.

The native module and the numpy fallback must agree on every input (valid or not), so the fallback
is used as the reference for randomised comparisons.
"""

from __future__ import annotations

import re
import time
from typing import Any

import numpy as np
import pytest

import tandem.csrc as csrc
from tandem.backend.errors import InvalidInput
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.prompt import (
    MAX_TOKENS,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    VOICE_ID,
    RequestParams,
    check_prompt,
    pack_prompt,
    parse_params,
)
from tandem.backend.settings import Limits

CFG: ModelConfig = preset("tiny")  # vocab 1024, row_width 4
LIMITS = Limits(max_prompt_rows=16, max_new_rows=2048, default_new_rows=256)


def _rows(n: int, width: int = 4, dtype: Any = np.int64) -> np.ndarray:
    return (np.arange(n * width) % CFG.vocab_size).reshape(n, width).astype(dtype)


def _with(n: int, at: tuple[int, int], value: int) -> np.ndarray:
    arr = _rows(n)
    arr[at] = value
    return arr


BAD_ARRAYS = [
    ("fp32", _rows(3, dtype=np.float32), "PROMPT must be INT64, got FP32"),
    ("int32", _rows(3, dtype=np.int32), "PROMPT must be INT64, got INT32"),
    ("bytes", np.array([b"x"], dtype=object), "PROMPT must be INT64, got BYTES"),
    ("big-endian", _rows(3, dtype=">i8"), "PROMPT must be INT64, got INT64 (non-native byte order)"),
    ("list", [[1, 2, 3, 4]], "PROMPT must be an INT64 tensor, got list"),
    ("1-D", np.arange(8, dtype=np.int64), "PROMPT must have shape [rows, 4], got [8]"),
    ("3-D", np.zeros((1, 2, 4), dtype=np.int64), "PROMPT must have shape [rows, 4], got [1, 2, 4]"),
    ("0-D", np.array(3, dtype=np.int64), "PROMPT must have shape [rows, 4], got []"),
    ("width", _rows(3, width=3), "PROMPT rows have width 3; this model's row_width is 4"),
    ("empty", np.zeros((0, 4), dtype=np.int64), "PROMPT has 0 rows; at least 1 is required"),
    ("too many rows", _rows(17), "PROMPT has 17 rows; the limit is 16"),
    ("negative id", _with(3, (1, 2), -1), "PROMPT[1, 2] = -1 is outside the vocabulary [0, 1024)"),
    ("id = vocab", _with(3, (0, 3), 1024), "PROMPT[0, 3] = 1024 is outside the vocabulary [0, 1024)"),
    ("huge id", _with(16, (15, 0), 2**62), f"PROMPT[15, 0] = {2**62} is outside the vocabulary [0, 1024)"),
    (
        "int64 min",
        _with(2, (1, 1), -(2**63)),
        f"PROMPT[1, 1] = {-(2**63)} is outside the vocabulary [0, 1024)",
    ),
    (
        "first in row-major order",
        _with(4, (2, 0), 5000),
        "PROMPT[2, 0] = 5000 is outside the vocabulary [0, 1024)",
    ),
]


@pytest.mark.parametrize(("arr", "message"), [c[1:] for c in BAD_ARRAYS], ids=[c[0] for c in BAD_ARRAYS])
def test_check_prompt_rejects(arr: Any, message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        check_prompt(arr, CFG, LIMITS)
    assert info.value.detail == message
    assert str(info.value) == f"[INVALID_ARG] {message}"


def test_check_prompt_returns_contiguous_int64() -> None:
    arr = _rows(16)
    assert check_prompt(arr, CFG, LIMITS) is arr  # no copy when nothing needs fixing
    view = np.asfortranarray(_rows(8))[::-1]
    out = check_prompt(view, CFG, LIMITS)
    assert out.flags.c_contiguous and out.dtype == np.int64
    np.testing.assert_array_equal(out, view)


def test_check_prompt_scans_non_contiguous_views() -> None:
    base = np.zeros((8, 8), dtype=np.int64)
    base[5, 6] = 4096
    view = base[:, ::2]  # width 4, column stride 16 bytes; the bad id is at view[5, 3]
    with pytest.raises(InvalidInput, match=r"PROMPT\[5, 3\] = 4096 is outside"):
        check_prompt(view, CFG, LIMITS)
    np.testing.assert_array_equal(check_prompt(base[:, 1::2][:5], CFG, LIMITS), base[:5, 1::2])


BAD_LISTS = [
    ("not a list", "1 2 3 4", "PROMPT must be a list of rows, got str"),
    ("ndarray", _rows(2), "PROMPT must be a list of rows, got ndarray"),
    ("empty", [], "PROMPT has 0 rows; at least 1 is required"),
    ("too many rows", [[0, 1, 2, 3]] * 17, "PROMPT has 17 rows; the limit is 16"),
    ("ragged", [[0, 1, 2, 3], [0, 1, 2]], "PROMPT row 1 has 3 ids; expected 4"),
    ("one id", [[0, 1, 2, 3], [7]], "PROMPT row 1 has 1 id; expected 4"),
    ("row not a list", [[0, 1, 2, 3], 7], "PROMPT row 1 must be a list of ids, got int"),
    ("row is a string", ["abcd"], "PROMPT row 0 must be a list of ids, got str"),
    ("float id", [[0, 1, 2, 3], [0, 1.0, 2, 3]], "PROMPT[1, 1] is not an integer (got float)"),
    ("bool id", [[0, True, 2, 3]], "PROMPT[0, 1] is not an integer (got bool)"),
    ("None id", [[0, 1, 2, None]], "PROMPT[0, 3] is not an integer (got NoneType)"),
    ("str id", [[0, "1", 2, 3]], "PROMPT[0, 1] is not an integer (got str)"),
    ("numpy id", [[0, np.int64(1), 2, 3]], "PROMPT[0, 1] is not an integer (got int64)"),
    ("negative id", [[0, 1, 2, 3], [0, 1, -5, 3]], "PROMPT[1, 2] = -5 is outside the vocabulary [0, 1024)"),
    ("id = vocab", [[1024, 1, 2, 3]], "PROMPT[0, 0] = 1024 is outside the vocabulary [0, 1024)"),
    ("beyond int64", [[0, 2**70, 2, 3]], f"PROMPT[0, 1] = {2**70} is outside the vocabulary [0, 1024)"),
    (
        "beyond -int64",
        [[0, 1, -(2**64), 3]],
        f"PROMPT[0, 2] = {-(2**64)} is outside the vocabulary [0, 1024)",
    ),
]


@pytest.mark.parametrize(("rows", "message"), [c[1:] for c in BAD_LISTS], ids=[c[0] for c in BAD_LISTS])
def test_pack_prompt_rejects(rows: Any, message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        pack_prompt(rows, CFG, LIMITS)
    assert info.value.detail == message


def test_pack_prompt_packs_lists_and_tuples() -> None:
    rows = [[0, 1, 2, 3], (1023, 0, 5, 6), [4, 4, 4, 4]]
    out = pack_prompt(rows, CFG, LIMITS)
    assert out.dtype == np.int64 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, np.array([list(r) for r in rows]))
    np.testing.assert_array_equal(pack_prompt(tuple(rows), CFG, LIMITS), out)


# --- scalar parameters ------------------------------------------------------------------------------


def _i32(v: int) -> np.ndarray:
    return np.array([v], dtype=np.int32)


def _f32(v: float) -> np.ndarray:
    return np.array([v], dtype=np.float32)


BAD_PARAMS = [
    ("temp NaN", {TEMPERATURE: _f32(np.nan)}, "TEMPERATURE = nan is not a finite number"),
    ("temp inf", {TEMPERATURE: _f32(np.inf)}, "TEMPERATURE = inf is not a finite number"),
    ("temp negative", {TEMPERATURE: _f32(-0.5)}, "TEMPERATURE = -0.5 is outside [0, 10]"),
    ("temp too high", {TEMPERATURE: _f32(10.5)}, "TEMPERATURE = 10.5 is outside [0, 10]"),
    ("temp FP64", {TEMPERATURE: np.array([0.7])}, "TEMPERATURE must be FP32, got FP64"),
    (
        "temp shape [2]",
        {TEMPERATURE: np.array([0.7, 0.7], np.float32)},
        "TEMPERATURE must have shape [1], got [2]",
    ),
    ("top_p 0", {TOP_P: _f32(0.0)}, "TOP_P = 0.0 is outside (0, 1]"),
    ("top_p > 1", {TOP_P: _f32(1.5)}, "TOP_P = 1.5 is outside (0, 1]"),
    ("top_p NaN", {TOP_P: _f32(np.nan)}, "TOP_P = nan is not a finite number"),
    ("max_tokens 0", {MAX_TOKENS: _i32(0)}, "MAX_TOKENS = 0 is outside [1, 2048]"),
    ("max_tokens too large", {MAX_TOKENS: _i32(2049)}, "MAX_TOKENS = 2049 is outside [1, 2048]"),
    ("max_tokens INT64", {MAX_TOKENS: np.array([5], np.int64)}, "MAX_TOKENS must be INT32, got INT64"),
    ("max_tokens FP32", {MAX_TOKENS: _f32(5)}, "MAX_TOKENS must be INT32, got FP32"),
    (
        "max_tokens shape [2]",
        {MAX_TOKENS: np.array([5, 5], np.int32)},
        "MAX_TOKENS must have shape [1], got [2]",
    ),
    ("max_tokens shape []", {MAX_TOKENS: np.array(5, np.int32)}, "MAX_TOKENS must have shape [1], got []"),
    (
        "max_tokens [1, 1]",
        {MAX_TOKENS: np.array([[5]], np.int32)},
        "MAX_TOKENS must have shape [1], got [1, 1]",
    ),
    ("max_tokens list", {MAX_TOKENS: [5]}, "MAX_TOKENS must be a tensor, got list"),
    ("top_k negative", {TOP_K: _i32(-1)}, "TOP_K = -1 is outside [0, 1024]"),
    ("top_k > vocab", {TOP_K: _i32(1025)}, "TOP_K = 1025 is outside [0, 1024]"),
    ("seed INT32", {SEED: _i32(7)}, "SEED must be INT64, got INT32"),
    ("seed shape [2]", {SEED: np.array([1, 2], np.int64)}, "SEED must have shape [1], got [2]"),
    ("voice INT32", {VOICE_ID: _i32(3)}, "VOICE_ID must be BYTES, got INT32"),
    (
        "voice too long",
        {VOICE_ID: np.array([b"v" * 257], dtype=object)},
        "VOICE_ID is 257 bytes; the limit is 256",
    ),
    (
        "voice not UTF-8",
        {VOICE_ID: np.array([b"ab\xff"], dtype=object)},
        "VOICE_ID is not valid UTF-8 (byte 2)",
    ),
    (
        "voice element",
        {VOICE_ID: np.array([3], dtype=object)},
        "VOICE_ID must be BYTES, got an element of type int",
    ),
    (
        "voice shape [2]",
        {VOICE_ID: np.array([b"a", b"b"], dtype=object)},
        "VOICE_ID must have shape [1], got [2]",
    ),
]


@pytest.mark.parametrize(("inputs", "message"), [c[1:] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS])
def test_parse_params_rejects(inputs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_params(inputs, CFG, LIMITS)
    assert info.value.detail == message


def test_parse_params_defaults() -> None:
    params = parse_params({"PROMPT": _rows(2), TEMPERATURE: None}, CFG, LIMITS)
    assert params == RequestParams(
        max_new_rows=256, temperature=1.0, top_p=1.0, top_k=0, seed=None, voice_id=""
    )


def test_parse_params_accepts_bounds_and_returns_python_values() -> None:
    params = parse_params(
        {
            MAX_TOKENS: _i32(2048),
            TEMPERATURE: _f32(0.0),
            TOP_P: _f32(1.0),
            TOP_K: _i32(1024),
            SEED: np.array([-(2**63)], np.int64),
            VOICE_ID: np.array(["é" * 128], dtype=object),  # 256 bytes of UTF-8; str elements too
        },
        CFG,
        LIMITS,
    )
    assert params == RequestParams(2048, 0.0, 1.0, 1024, -(2**63), "é" * 128)
    for value, kind in zip(
        (params.max_new_rows, params.temperature, params.top_p, params.top_k, params.seed, params.voice_id),
        (int, float, float, int, int, str),
        strict=True,
    ):
        assert type(value) is kind
    assert parse_params({VOICE_ID: np.array([b"alto"], dtype="S")}, CFG, LIMITS).voice_id == "alto"
    assert parse_params({TOP_P: _f32(1e-6)}, CFG, LIMITS).top_p == pytest.approx(1e-6)


# --- native vs fallback -----------------------------------------------------------------------------


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        out = fn(*args)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", None if out is None else (out.dtype.str, out.shape, out.tobytes())


def _random_arrays(rng: np.random.Generator) -> list[Any]:
    cases: list[Any] = []
    for _ in range(300):
        n = int(rng.integers(0, 20))
        w = int(rng.choice([3, 4, 4, 4, 5]))
        arr = rng.integers(0, 1024, size=(n, w), dtype=np.int64)
        if n and w and rng.random() < 0.5:
            for _ in range(int(rng.integers(1, 3))):
                arr[rng.integers(0, n), rng.integers(0, w)] = rng.choice([-1, 1024, 2**40, -(2**63), 5000])
        pick = rng.integers(0, 6)
        if pick == 1:
            arr = np.asfortranarray(arr)
        elif pick == 2:
            arr = arr[::-1]
        elif pick == 3:
            arr = np.repeat(arr, 2, axis=1)[:, ::2]
        elif pick == 4:
            arr = arr.astype(rng.choice(["int32", "float32", ">i8", "uint64"]))
        cases.append(arr)
    cases += [np.arange(4, dtype=np.int64), np.zeros((1, 1, 4), np.int64), [[0, 1, 2, 3]], None]
    return cases


def _random_lists(rng: np.random.Generator) -> list[Any]:
    cases: list[Any] = []
    junk: list[Any] = [1.5, True, None, "3", -1, 1024, 2**70, -(2**70), np.int64(3), [1]]
    for _ in range(300):
        n = int(rng.integers(0, 20))
        rows: list[Any] = [[int(x) for x in rng.integers(0, 1024, size=4)] for _ in range(n)]
        if n and rng.random() < 0.6:
            i = int(rng.integers(0, n))
            kind = rng.integers(0, 3)
            if kind == 0:
                rows[i][int(rng.integers(0, 4))] = junk[int(rng.integers(0, len(junk)))]
            elif kind == 1:
                rows[i] = rows[i][: int(rng.integers(0, 4))]
            else:
                rows[i] = tuple(rows[i]) if rng.random() < 0.5 else 7
        cases.append(tuple(rows) if rng.random() < 0.2 else rows)
    cases += ["abcd", {0: [0, 1, 2, 3]}, _rows(2)]
    return cases


def test_native_matches_reference() -> None:
    if not csrc.NATIVE:
        pytest.skip(f"native module not built: {csrc.build_info()}")
    rng = np.random.default_rng(1234)
    for arr in _random_arrays(rng):
        for limits in ((4, 1024, 16), (4, 1024, 3)):
            assert _outcome(csrc.validate_rows, arr, *limits) == _outcome(
                csrc.reference_validate_rows, arr, *limits
            ), arr
    for rows in _random_lists(rng):
        for limits in ((4, 1024, 16), (4, 1024, 3)):
            assert _outcome(csrc.pack_rows, rows, *limits) == _outcome(
                csrc.reference_pack_rows, rows, *limits
            ), rows
    for bad_limits in ((0, 1024, 16), (4, 0, 16), (4, 1024, 0)):
        assert _outcome(csrc.validate_rows, _rows(2), *bad_limits) == _outcome(
            csrc.reference_validate_rows, _rows(2), *bad_limits
        )
        assert _outcome(csrc.pack_rows, [[0]], *bad_limits) == _outcome(
            csrc.reference_pack_rows, [[0]], *bad_limits
        )


def test_native_is_fast_on_a_large_prompt() -> None:
    """A 4096-row prompt must validate in well under a millisecond per hundred rows (design check)."""
    if not csrc.NATIVE:
        pytest.skip(f"native module not built: {csrc.build_info()}")
    arr = _rows(4096)
    rows = arr.tolist()
    start = time.perf_counter()
    for _ in range(10):
        csrc.validate_rows(arr, 4, 1024, 4096)
        packed = csrc.pack_rows(rows, 4, 1024, 4096)
    assert time.perf_counter() - start < 0.5
    np.testing.assert_array_equal(packed, arr)


def test_build_info_names_the_implementation() -> None:
    info = csrc.build_info()
    assert ("_native" in info) == csrc.NATIVE


# CSM's rows: 3 codebook columns of 2,051 ids and a text column of 300, any column absent (-1).
CSM_CFG = ModelConfig(
    vocab_size=2051,
    row_width=4,
    hidden_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    text_vocab_size=300,
)


def test_csm_rows_check_each_column_against_its_own_range() -> None:
    ok = np.array([[-1, -1, -1, 299], [2050, 0, 7, -1], [-1, 5, -1, -1]], dtype=np.int64)
    np.testing.assert_array_equal(check_prompt(ok, CSM_CFG, LIMITS), ok)
    np.testing.assert_array_equal(pack_prompt(ok.tolist(), CSM_CFG, LIMITS), ok)
    for at, value, message in (
        ((1, 3), 300, "PROMPT[1, 3] = 300 is outside column 3's ids [-1, 300)"),  # a code-sized text id
        ((0, 1), 2051, "PROMPT[0, 1] = 2051 is outside column 1's ids [-1, 2051)"),
        ((2, 0), -2, "PROMPT[2, 0] = -2 is outside column 0's ids [-1, 2051)"),
    ):
        bad = ok.copy()
        bad[at] = value
        with pytest.raises(InvalidInput, match=re.escape(message)):
            check_prompt(bad, CSM_CFG, LIMITS)
        with pytest.raises(InvalidInput, match=re.escape(message)):
            pack_prompt(bad.tolist(), CSM_CFG, LIMITS)
    with pytest.raises(InvalidInput, match="outside the vocabulary"):  # plain rows: -1 is no id
        check_prompt(np.array([[-1, 0, 0, 0]], dtype=np.int64), CFG, LIMITS)


def test_native_matches_reference_on_column_ranges() -> None:
    if not csrc.NATIVE:
        pytest.skip(f"native module not built: {csrc.build_info()}")
    rng = np.random.default_rng(99)
    bounds = [(), (5, 5, 5, 3), (1024, 1024, 1024, 40)]
    for _ in range(300):
        arr = rng.integers(-3, 60, size=(int(rng.integers(1, 6)), 4), dtype=np.int64)
        if rng.random() < 0.3:
            arr = arr[:, ::-1]  # a strided view
        for column_vocab in bounds:
            for min_id in (0, -1):
                args = (4, 1024, 16, column_vocab, min_id)
                assert _outcome(csrc.validate_rows, arr, *args) == _outcome(
                    csrc.reference_validate_rows, arr, *args
                ), (arr, column_vocab, min_id)
                rows = arr.tolist()
                assert _outcome(csrc.pack_rows, rows, *args) == _outcome(
                    csrc.reference_pack_rows, rows, *args
                ), (rows, column_vocab, min_id)
    for bad in (((5, 5), 0), ((5, 5, 0, 5), 0), ((), -2)):
        args = (4, 1024, 16, *bad)
        assert _outcome(csrc.validate_rows, _rows(2), *args) == _outcome(
            csrc.reference_validate_rows, _rows(2), *args
        )
        assert "ValueError" in str(_outcome(csrc.pack_rows, [[0] * 4], *args))
