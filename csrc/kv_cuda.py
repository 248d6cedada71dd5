"""KV gather / scatter / fused gather-write over a layer-major paged pool, CUDA kernels with a torch fallback.

Why: the P->D hand-off moves one request's KV out of P's paged pool and into D's (design.md §1). Pools
fragment (page size 1, shuffled slots: every row its own chunk), and a copy per chunk is never
acceptable; these kernels move whole rows with 16-byte vectors whatever the fragmentation, so P
gathers into one contiguous staging buffer, one copy crosses, and D scatters.

Shapes (every tensor contiguous; `R` = any trailing row shape, e.g. `(num_kv_heads, head_dim)`):

    pool     [L, 2, S, *R]   a KVPool's `kv`; a slot is one row of the token axis
    staging  [L, 2, T, *R]   contiguous, the wire layout (`WireLayout.staging_shape(T)`)
    slots    [T] int64       slot of each token, on the pool's device (for `gather_write`: the source's)

The compiled kernels (`tandem.csrc._cuda_kernels`, built by `csrc/build_cuda.py`) run when the module is
built and the tensors are on a CUDA device; otherwise the `reference_*` functions (torch `index_select`
/ `index_copy_`) run, which are also what the tests hold the kernels to. Kernels are asynchronous on the
current stream of the device they run on, like any torch op. Each wrapper checks dtype, device,
contiguity, shapes and (unless `check_bounds=False`, which saves a device sync) slot bounds before
launching, and raises `ValueError` / `TypeError` naming the problem.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

__all__ = [
    "build_info",
    "gather",
    "gather_write",
    "module",
    "reference_gather",
    "reference_gather_write",
    "reference_scatter",
    "scatter",
    "uses_kernels",
]

_MODULE: ModuleType | None = None
_IMPORT_ERROR: str | None = None
try:
    _MODULE = importlib.import_module("tandem.csrc._cuda_kernels")
except ImportError as exc:  # not built (CPU machines): every entry point falls back to torch
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def module() -> ModuleType | None:
    """The compiled `_cuda_kernels` module, or None when it was not built (see `build_info`)."""
    return _MODULE


def build_info() -> str:
    """One line for logs: whether the kernels are built, and why not."""
    if _MODULE is None:
        return f"tandem.csrc._cuda_kernels not built ({_IMPORT_ERROR}); run `python csrc/build_cuda.py`"
    return f"tandem.csrc._cuda_kernels built ({_MODULE.__file__})"


def uses_kernels(t: torch.Tensor) -> bool:
    """True when an op on tensors like `t` runs the compiled kernels rather than the torch reference."""
    return _MODULE is not None and t.is_cuda


# ---- references (also the CPU path) ------------------------------------------------------------------


def reference_gather(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """`out[:, :, t] = pool[:, :, slots[t]]` with `index_select` (out written)."""
    torch.index_select(pool, 2, slots, out=out)


def reference_scatter(staging: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """`pool[:, :, slots[t]] = staging[:, :, t]` with `index_copy_` (pool written)."""
    pool.index_copy_(2, slots, staging)


def reference_gather_write(
    src_pool: torch.Tensor, src_slots: torch.Tensor, dst_pool: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """`dst_pool[:, :, dst_slots[t]] = src_pool[:, :, src_slots[t]]` via a temporary (dst_pool written)."""
    rows = torch.index_select(src_pool, 2, src_slots).to(dst_pool.device)
    dst_pool.index_copy_(2, dst_slots.to(dst_pool.device), rows)


# ---- checks ------------------------------------------------------------------------------------------


def _check_pool(name: str, pool: torch.Tensor) -> None:
    if pool.dim() < 4 or pool.shape[1] != 2:
        raise ValueError(f"{name} must be [L, 2, S, *row] (layer-major K/V), got shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_slots(
    name: str, slots: torch.Tensor, device: torch.device, n_rows: int, check_bounds: bool
) -> None:
    if slots.dtype != torch.int64:
        raise TypeError(f"{name} must be int64, got {slots.dtype}")
    if slots.dim() != 1 or slots.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device}, expected {device}")
    if not slots.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if check_bounds:
        lo, hi = int(slots.min().item()), int(slots.max().item())
        if lo < 0 or hi >= n_rows:
            raise ValueError(f"{name} holds slots in [{lo}, {hi}], outside the pool's [0, {n_rows})")


def _check_staging(staging: torch.Tensor, pool: torch.Tensor, n_tokens: int) -> None:
    want = (*pool.shape[:2], n_tokens, *pool.shape[3:])
    if tuple(staging.shape) != want:
        raise ValueError(f"staging has shape {tuple(staging.shape)}, expected {want} for this pool")
    if staging.dtype != pool.dtype:
        raise TypeError(f"staging is {staging.dtype} but the pool is {pool.dtype}")
    if staging.device != pool.device:
        raise ValueError(f"staging is on {staging.device} but the pool is on {pool.device}")
    if not staging.is_contiguous():
        raise ValueError("staging must be contiguous")


def _geometry(pool: torch.Tensor) -> tuple[int, int, int]:
    """(num_lt, pool_rows, row_bytes)."""
    return pool.shape[0] * 2, pool.shape[2], math.prod(pool.shape[3:]) * pool.element_size()


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream)


# ---- entry points ------------------------------------------------------------------------------------


def gather(pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, *, check_bounds: bool = True) -> None:
    """P side: copy the rows of `slots` out of `pool` into contiguous `out` (`out` written; pool read).

    `out` is `[L, 2, T, *R]` with `T = len(slots)`, same dtype and device as `pool`. Ordered on the
    device's current stream; `out` is ready for the next op on that stream.
    """
    _check_pool("pool", pool)
    _check_slots("slots", slots, pool.device, pool.shape[2], check_bounds)
    _check_staging(out, pool, slots.numel())
    if not uses_kernels(pool):
        reference_gather(pool, slots, out)
        return
    assert _MODULE is not None
    num_lt, rows, row_bytes = _geometry(pool)
    dev = pool.device.index
    _MODULE.gather(
        pool.data_ptr(),
        rows,
        slots.data_ptr(),
        out.data_ptr(),
        num_lt,
        slots.numel(),
        row_bytes,
        dev,
        _stream(pool.device),
    )


def scatter(
    staging: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, *, check_bounds: bool = True
) -> None:
    """D side: write contiguous `staging` into `pool` at `slots` (`pool` written; staging read).

    Duplicate slots leave one of the writers' rows (unspecified which), as with `index_copy_`.
    `staging` may be reused once the current stream has passed this op.
    """
    _check_pool("pool", pool)
    _check_slots("slots", slots, pool.device, pool.shape[2], check_bounds)
    _check_staging(staging, pool, slots.numel())
    if not uses_kernels(pool):
        reference_scatter(staging, pool, slots)
        return
    assert _MODULE is not None
    num_lt, rows, row_bytes = _geometry(pool)
    dev = pool.device.index
    _MODULE.scatter(
        staging.data_ptr(),
        pool.data_ptr(),
        rows,
        slots.data_ptr(),
        num_lt,
        slots.numel(),
        row_bytes,
        dev,
        _stream(pool.device),
    )


def gather_write(
    src_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> None:
    """Fused hand-off: read `src_pool` at `src_slots`, write `dst_pool` at `dst_slots` (`dst_pool` written).

    The kernel runs on `src_pool`'s device and writes `dst_pool` directly, which may live on another
    GPU (peer access is enabled here) or be another process's pool mapped into this one (an IPC or VMM
    mapping wrapped as a tensor). Both slot tensors must be on the source's device. No staging buffer,
    so there is nothing to checksum between the two sides: the transfer paths use gather -> copy ->
    scatter instead and keep this for callers that verify the destination themselves.
    """
    _check_pool("src_pool", src_pool)
    _check_pool("dst_pool", dst_pool)
    if src_pool.dtype != dst_pool.dtype:
        raise TypeError(f"src_pool is {src_pool.dtype} but dst_pool is {dst_pool.dtype}")
    if src_pool.shape[:2] != dst_pool.shape[:2] or src_pool.shape[3:] != dst_pool.shape[3:]:
        raise ValueError(
            f"pool shapes differ beyond the slot axis: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}"
        )
    _check_slots("src_slots", src_slots, src_pool.device, src_pool.shape[2], check_bounds)
    _check_slots("dst_slots", dst_slots, src_pool.device, dst_pool.shape[2], check_bounds)
    if src_slots.numel() != dst_slots.numel():
        raise ValueError(f"{src_slots.numel()} source slots but {dst_slots.numel()} destination slots")
    if not (uses_kernels(src_pool) and dst_pool.is_cuda):
        reference_gather_write(src_pool, src_slots, dst_pool, dst_slots)
        return
    assert _MODULE is not None
    num_lt, src_rows, row_bytes = _geometry(src_pool)
    dev = src_pool.device.index
    if dst_pool.device != src_pool.device:
        _MODULE.enable_peer_access(dev, dst_pool.device.index)
    _MODULE.gather_write(
        src_pool.data_ptr(),
        src_rows,
        src_slots.data_ptr(),
        dst_pool.data_ptr(),
        dst_pool.shape[2],
        dst_slots.data_ptr(),
        num_lt,
        src_slots.numel(),
        row_bytes,
        dev,
        _stream(src_pool.device),
    )
