"""Native helpers behind a pure-numpy fallback with identical semantics and messages.

`validate_rows` and `pack_rows` check a TTS prompt ([N, W] codec ids). They come from the compiled
`_native` module when it was built (GIL released while scanning; lists packed in one pass without
per-id Python objects) and from the `reference_*` functions below otherwise. The reference functions
are always importable: the unit tests hold the native module to them.

Error contract, shared by both implementations:
- `TypeError`: `validate_rows` got something other than a numpy int64 array (a caller bug; the
  Python wrapper in `backend/prompt.py` checks the dtype first so clients never see this).
- `ValueError`: anything wrong with the prompt itself, naming the first problem in row-major order,
  e.g. ``PROMPT[12, 3] = 70000 is outside the vocabulary [0, 1024)``; also non-positive limits.

Nothing is logged at import: whether the native path is in use is visible as `NATIVE` and
`build_info()`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "NATIVE",
    "build_info",
    "pack_rows",
    "reference_pack_rows",
    "reference_validate_rows",
    "validate_rows",
]


def _check_limits(row_width: int, vocab_size: int, max_rows: int) -> None:
    for name, value in (("row_width", row_width), ("vocab_size", vocab_size), ("max_rows", max_rows)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_row_count(rows: int, max_rows: int) -> None:
    if rows < 1:
        raise ValueError("PROMPT has 0 rows; at least 1 is required")
    if rows > max_rows:
        raise ValueError(f"PROMPT has {rows} rows; the limit is {max_rows}")


def _outside_vocab(row: int, col: int, value: int, vocab_size: int) -> str:
    return f"PROMPT[{row}, {col}] = {value} is outside the vocabulary [0, {vocab_size})"


def _ranges(row_width: int, vocab_size: int, column_vocab: Sequence[int], min_id: int) -> np.ndarray:
    """Each column's upper bound (int64 [W]), after the checks `check_ranges` (prompt.h) makes."""
    if column_vocab and len(column_vocab) != row_width:
        raise ValueError(f"column_vocab has {len(column_vocab)} bounds; row_width is {row_width}")
    for h in column_vocab:
        if h < 1:
            raise ValueError(f"column_vocab bounds must be >= 1, got {h}")
    if min_id not in (0, -1):
        raise ValueError(f"min_id must be 0 or -1, got {min_id}")
    return np.asarray(column_vocab if column_vocab else [vocab_size] * row_width, dtype=np.int64)


def _outside(
    row: int, col: int, value: int, vocab_size: int, hi: np.ndarray, min_id: int, uniform: bool
) -> str:
    if uniform:
        return _outside_vocab(row, col, value, vocab_size)
    return f"PROMPT[{row}, {col}] = {value} is outside column {col}'s ids [{min_id}, {int(hi[col])})"


def reference_validate_rows(
    arr: np.ndarray,
    row_width: int,
    vocab_size: int,
    max_rows: int,
    column_vocab: Sequence[int] = (),
    min_id: int = 0,
) -> None:
    """Pure-numpy `validate_rows`: same checks, order and messages as `_native.validate_rows`.
    `column_vocab` (one bound per column; empty: vocab_size for each) and `min_id` (0, or -1 where a
    column may be absent): column j's ids lie in [min_id, column_vocab[j]).

    Vectorised, so it is only a constant factor slower than the native scan; non-contiguous arrays
    are handled by numpy without a copy of the ids (the comparison allocates one bool mask).
    """
    _check_limits(row_width, vocab_size, max_rows)
    hi = _ranges(row_width, vocab_size, column_vocab, min_id)
    uniform = not column_vocab and min_id == 0
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"PROMPT must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(np.int64):
        raise TypeError(f"PROMPT must be an int64 array, got {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"PROMPT must have 2 dimensions [rows, row_width]; got {arr.ndim}")
    _check_row_count(arr.shape[0], max_rows)
    if arr.shape[1] != row_width:
        raise ValueError(f"PROMPT rows have width {arr.shape[1]}; this model's row_width is {row_width}")
    bad = (arr < min_id) | (arr >= hi[None, :])
    if bad.any():
        row, col = np.unravel_index(int(np.argmax(bad)), bad.shape)  # argmax: first True in C order
        raise ValueError(_outside(int(row), int(col), int(arr[row, col]), vocab_size, hi, min_id, uniform))


def reference_pack_rows(
    rows: Sequence[Sequence[int]],
    row_width: int,
    vocab_size: int,
    max_rows: int,
    column_vocab: Sequence[int] = (),
    min_id: int = 0,
) -> np.ndarray:
    """Pure-Python `pack_rows`: same checks, order and messages as `_native.pack_rows`.

    Only list/tuple containers and Python ints (not bools) are accepted, because that is what a JSON
    decoder produces; anything else is a client error, not something to coerce.
    """
    _check_limits(row_width, vocab_size, max_rows)
    hi = _ranges(row_width, vocab_size, column_vocab, min_id)
    uniform = not column_vocab and min_id == 0
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"PROMPT must be a list of rows, got {type(rows).__name__}")
    _check_row_count(len(rows), max_rows)
    out = np.empty((len(rows), row_width), dtype=np.int64)
    for i, row in enumerate(rows):
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"PROMPT row {i} must be a list of ids, got {type(row).__name__}")
        if len(row) != row_width:
            ids = "id" if len(row) == 1 else "ids"
            raise ValueError(f"PROMPT row {i} has {len(row)} {ids}; expected {row_width}")
        for j, item in enumerate(row):
            if not isinstance(item, int) or isinstance(item, bool):
                raise ValueError(f"PROMPT[{i}, {j}] is not an integer (got {type(item).__name__})")
            value = int(item)
            if not min_id <= value < hi[j]:
                raise ValueError(_outside(i, j, value, vocab_size, hi, min_id, uniform))
            out[i, j] = value
    return out


validate_rows: Callable[..., None]
pack_rows: Callable[..., np.ndarray]
_native: Any  # the compiled module has no stub; importlib keeps mypy from needing one

try:
    _native = importlib.import_module("tandem.csrc._native")
except ImportError:  # not built (no compiler, or a source checkout): numpy fallback, same behaviour
    _native = None
    NATIVE = False
    validate_rows = reference_validate_rows
    pack_rows = reference_pack_rows
else:
    NATIVE = True
    validate_rows = _native.validate_rows
    pack_rows = _native.pack_rows


def build_info() -> str:
    """Which implementation is in use and how it was built (for logs and bug reports)."""
    if _native is None:
        return "tandem.csrc pure-numpy fallback (native module not built)"
    return str(_native.build_info())
