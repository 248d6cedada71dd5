"""KV gather / scatter / fused gather-write over a layer-major paged pool, CUDA kernels with a torch fallback.

Why: the P->D hand-off moves one request's KV out of P's paged pool and into D's (docs/transfer.md). Pools
fragment (page size 1, shuffled slots: every row its own chunk), and a copy per chunk is never
acceptable; these kernels move whole rows with 16-byte vectors whatever the fragmentation, so P
gathers into one contiguous staging buffer, one copy crosses, and D scatters.

Shapes (every tensor contiguous; `R` = any trailing row shape, e.g. `(num_kv_heads, head_dim)`):

    pool     [L, 2, S, *R]   a KVPool's `kv`; a slot is one row of the token axis
    staging  [L, 2, T, *R]   contiguous, the wire layout (`WireLayout.staging_shape(T)`)
    slots    [T] int64       slot of each token, on the pool's device (for `gather_write`: the source's)

`checksum_rows` hashes a request's rows where they lie, by slot, with transfer/checksum.py's definition
(the value `kv_checksum` gives the staging buffer a gather would fill); transfer/checksum.py holds the
torch reference and the CPU path, and `checksum_tensor` is the same kernel over any contiguous tensor.

`decode_attention` is the decode step's attention read in place from one layer of such a pool (one
query row per sequence over its own slots; see csrc/decode_attention.cu), with
`reference_decode_attention` (gather + masked SDPA) as its reference and CPU path.

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

from tandem.csrc.fp8 import dequantize_kv, is_fp8

__all__ = [
    "build_info",
    "checksum_rows",
    "checksum_rows_supported",
    "checksum_tensor",
    "checksum_tensor_supported",
    "decode_attention",
    "decode_attention_supported",
    "gather",
    "gather_write",
    "gather_write_checksum",
    "gather_write_checksum_supported",
    "kernel_decodes",
    "module",
    "reference_decode_attention",
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


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or its bytes for an E4M3 tensor (torch has no CPU index_copy_ for float8)."""
    return t.view(torch.uint8) if is_fp8(t) else t


def reference_scatter(staging: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> None:
    """`pool[:, :, slots[t]] = staging[:, :, t]` with `index_copy_` (pool written)."""
    _bytes(pool).index_copy_(2, slots, _bytes(staging))


def reference_gather_write(
    src_pool: torch.Tensor, src_slots: torch.Tensor, dst_pool: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """`dst_pool[:, :, dst_slots[t]] = src_pool[:, :, src_slots[t]]` via a temporary (dst_pool written)."""
    rows = torch.index_select(_bytes(src_pool), 2, src_slots).to(dst_pool.device)
    _bytes(dst_pool).index_copy_(2, dst_slots.to(dst_pool.device), rows)


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


def _check_pool_to_pool(
    src_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_slots: torch.Tensor,
    check_bounds: bool,
) -> None:
    """What `gather_write` and `gather_write_checksum` need of their arguments (raises naming it)."""
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
    _check_pool_to_pool(src_pool, src_slots, dst_pool, dst_slots, check_bounds)
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


def gather_write_checksum_supported(src_pool: torch.Tensor, dst_pool: torch.Tensor) -> bool:
    """True when `gather_write_checksum` has a kernel for these pools: CUDA (the source), module built,
    8-byte aligned bases and rows a multiple of 8 bytes. Otherwise hash and write separately."""
    if not (uses_kernels(src_pool) and dst_pool.is_cuda) or src_pool.dim() < 4:
        return False
    return (src_pool.data_ptr() | dst_pool.data_ptr()) % 8 == 0 and _geometry(src_pool)[2] % 8 == 0


def gather_write_checksum(
    src_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_pool: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    check_bounds: bool = True,
) -> torch.Tensor:
    """`gather_write` (`dst_pool` written) that also hashes the rows it moves, in one pass.

    Why: in direct mode P must checksum the rows it writes into D's pool; hashing them in a pass of
    their own costs a read of every byte before the write starts (~0.14 ms for 288 MiB on an H200).
    The fused kernel hashes each vector it stores, so the hash rides on the write (which over NVLink
    leaves the SMs mostly waiting). Returns an int64 [3] tensor on the source's device, written
    asynchronously on its current stream: the lanes (a, b) of transfer/checksum.py's definition over
    the rows in wire order — those of `checksum_rows(src_pool, src_slots)` — and 0. Same checks as
    `gather_write`; RuntimeError when `gather_write_checksum_supported` is False.
    """
    _check_pool_to_pool(src_pool, src_slots, dst_pool, dst_slots, check_bounds)
    if not gather_write_checksum_supported(src_pool, dst_pool):
        raise RuntimeError(f"no fused write-and-hash kernel for these pools; {build_info()}")
    assert _MODULE is not None
    num_lt, src_rows, row_bytes = _geometry(src_pool)
    dev = src_pool.device.index
    if dst_pool.device != src_pool.device:
        _MODULE.enable_peer_access(dev, dst_pool.device.index)
    out = torch.empty(3, dtype=torch.int64, device=src_pool.device)
    _MODULE.gather_write_checksum(
        src_pool.data_ptr(),
        src_rows,
        src_slots.data_ptr(),
        dst_pool.data_ptr(),
        dst_pool.shape[2],
        dst_slots.data_ptr(),
        num_lt,
        src_slots.numel(),
        row_bytes,
        out.data_ptr(),
        dev,
        _stream(src_pool.device),
    )
    return out


# ---- in-place checksum ------------------------------------------------------------------------------


def checksum_rows_supported(pool: torch.Tensor) -> bool:
    """True when `checksum_rows` can hash `pool`'s rows with the kernel: CUDA, module built, rows a
    multiple of 8 bytes and an 8-byte aligned base. Otherwise transfer/checksum.py uses torch."""
    if not uses_kernels(pool) or pool.dim() < 4:
        return False
    return pool.data_ptr() % 8 == 0 and _geometry(pool)[2] % 8 == 0


def checksum_tensor_supported(t: torch.Tensor) -> bool:
    """True when `checksum_tensor` can hash `t` with the kernel: CUDA, module built, contiguous, a
    multiple of 8 bytes from an 8-byte aligned base."""
    return uses_kernels(t) and t.is_contiguous() and t.data_ptr() % 8 == 0 and t.nbytes % 8 == 0


def _lanes(
    src: int, src_rows: int, slots: int, num_lt: int, n_tokens: int, row_bytes: int, device: torch.device
) -> torch.Tensor:
    assert _MODULE is not None
    out = torch.empty(3, dtype=torch.int64, device=device)
    _MODULE.checksum_rows(
        src, src_rows, slots, num_lt, n_tokens, row_bytes, out.data_ptr(), device.index, _stream(device)
    )
    return out


def checksum_rows(pool: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the checksum kernel over `pool`'s rows at `slots`, in wire order; returns its output.

    `pool` is `[L, 2, S, *R]` (contiguous); wire row `(lt, t)` is `pool[lt // 2, lt % 2, slots[t]]`, or
    the t-th row when `slots` is None (the whole tensor is then the staging buffer, `T = S`); `slots`
    may be empty. Returns an int64 [3] tensor on the pool's device, written asynchronously on its
    current stream: the lanes (a, b) of transfer/checksum.py's definition as wrapping int64, and the
    number of rows skipped because their slot was outside `[0, S)` (the kernel never reads outside
    the pool; the caller raises when it is not 0). transfer/checksum.py's `kv_checksum_rows` turns it
    into the checksum. Raises ValueError/TypeError on a bad pool or slots, RuntimeError when
    `checksum_rows_supported(pool)` is False.
    """
    _check_pool("pool", pool)
    if slots is not None:
        if slots.dtype != torch.int64:
            raise TypeError(f"slots must be int64, got {slots.dtype}")
        if slots.dim() != 1:
            raise ValueError(f"slots must be a 1-D tensor, got shape {tuple(slots.shape)}")
        if slots.device != pool.device:
            raise ValueError(f"slots is on {slots.device}, expected {pool.device}")
        if not slots.is_contiguous():
            raise ValueError("slots must be contiguous")
    if not checksum_rows_supported(pool):
        raise RuntimeError(f"no checksum kernel for this pool ({pool.device}, {pool.dtype}); {build_info()}")
    num_lt, rows, row_bytes = _geometry(pool)
    if slots is None:
        return _lanes(pool.data_ptr(), rows, 0, num_lt, rows, row_bytes, pool.device)
    return _lanes(pool.data_ptr(), rows, slots.data_ptr(), num_lt, slots.numel(), row_bytes, pool.device)


def checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """`checksum_rows` for any contiguous tensor: all of its bytes as one row (hashed as a flat array).

    Returns the same int64 [3] tensor (its third word is always 0), asynchronously on `t`'s device's
    current stream. Raises RuntimeError when `checksum_tensor_supported(t)` is False.
    """
    if not checksum_tensor_supported(t):
        raise RuntimeError(
            f"no checksum kernel for this tensor ({t.device}, {t.nbytes} bytes, contiguous "
            f"{t.is_contiguous()}, base {t.data_ptr():#x}); {build_info()}"
        )
    return _lanes(t.data_ptr(), 1, 0, 1, 1, t.nbytes, t.device)


# ---- paged decode attention ----------------------------------------------------------------------------

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# The decode-attention kernel: tensor cores (mma.sync) on K/V tiles staged in shared memory by cp.async
# for float16/bfloat16 with head_dim 64/128 and for an E4M3 KV (csrc/decode_attention_mma.cu, the
# default); the same staging with FMA arithmetic for every other shape, any group of 1..8
# (csrc/decode_attention_staged.cu, its fallback). csrc/decode_attention.cu picks between them.
# The split-K partials are merged in a second kernel. A merge inside the partial kernel (its last block
# per sequence and heads, on counters) was measured on an H200 and deleted: it made the graphed step
# slower at every point (Orpheus-3B 1 x 2048 2.71 -> 2.84 ms, 64 x 2048 6.92 -> 7.25; the 4B shape
# 3.36 -> 3.58 and 8.86 -> 9.37; docs/benchmarks).
_sm_counts: dict[int, int] = {}


def reference_decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference (and CPU path): each sequence's query attends over its first `lengths[b]` slots.

    q [B, NH, HD], kv [2, S_pool, KVH, HD] (one layer of the pool), slots [B, S] int64 (entries past a
    sequence's length are never read, whatever they hold), lengths [B] int64 in [1, S]. An E4M3 `kv`
    is read at `kv_scales` [2, KVH] (dequantised to q's dtype, `csrc/fp8.py`). Returns a new
    [B, NH, HD] tensor in q's dtype. Gathers the padded context, then masked SDPA.
    """
    b, s = slots.shape
    cols = torch.arange(s, device=slots.device)
    # Pad with each sequence's own last valid slot so masked reads stay finite.
    safe = slots.gather(1, torch.minimum(cols[None, :], lengths[:, None] - 1))
    rows = kv.index_select(1, safe.reshape(-1))
    if is_fp8(kv):
        if kv_scales is None:
            raise ValueError("an E4M3 kv needs kv_scales")
        rows = dequantize_kv(rows, kv_scales, q.dtype)
    ctx = rows.view(2, b, s, *kv.shape[2:]).transpose(2, 3)
    mask = (cols[None, :] < lengths[:, None])[:, None, None, :]
    o = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :], ctx[0], ctx[1], attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != kv.shape[2]
    )
    return o[:, :, 0, :]


def kernel_decodes(
    dtype: torch.dtype,
    device: torch.device,
    num_heads: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype | None = None,
) -> bool:
    """True when the compiled decode-attention kernel exists for this model shape on `device`: CUDA,
    module built, float32/float16/bfloat16, head_dim 64/128/256, and 1..8 query heads per KV head.
    `kv_dtype` (the pool's; default `dtype`) float8_e4m3fn: a float16/bfloat16 q, head_dim 64/128, on
    a module built with E4M3 support."""
    if _MODULE is None or device.type != "cuda" or dtype not in _DTYPE_CODES or num_heads % kv_heads:
        return False
    group = num_heads // kv_heads
    if kv_dtype is not None and is_fp8(kv_dtype):
        if not hasattr(_MODULE, "decode_attention_kv_fp8"):
            return False
        return bool(_MODULE.decode_attention_supported(_DTYPE_CODES[dtype], head_dim, group, True))
    if kv_dtype is not None and kv_dtype != dtype:
        return False
    return bool(_MODULE.decode_attention_supported(_DTYPE_CODES[dtype], head_dim, group))


def decode_attention_supported(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """True when `decode_attention` runs the compiled kernel for these tensors (`kernel_decodes` for
    their shape and dtypes, both on one CUDA device, 16-byte aligned); otherwise it runs
    `reference_decode_attention`."""
    if q.dim() != 3 or kv.dim() != 4 or q.device != kv.device:
        return False
    if q.data_ptr() % 16 or kv.data_ptr() % 16:
        return False
    return kernel_decodes(q.dtype, q.device, q.shape[1], kv.shape[2], q.shape[2], kv.dtype)


def _chunk(batch: int, kv_heads: int, s: int, device: torch.device) -> int:
    """Tokens per split: 256, halved until the grid has ~3 blocks per SM (a block's tiles take 68 KiB of
    shared memory: three fit an SM), down to 128 tokens (a 32-token tile for each of a block's four
    warps; fewer splits also make the merge cheaper at small batch). Depends only on shapes, so a
    captured graph keeps its grid."""
    index = device.index or 0
    sms = _sm_counts.get(index)
    if sms is None:
        sms = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    chunk = 256
    floor, per_sm = 128, 3
    while chunk > floor and batch * kv_heads * -(-s // chunk) < per_sm * sms:
        chunk //= 2
    return chunk


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    chunk: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode-step attention reading K/V in place from one layer of a paged pool (no gathered context).

    An E4M3 `kv` needs `kv_scales` [2, KVH] float32 (contiguous, on kv's device: K's then V's scale of
    each KV head); the kernel converts each staged tile to float16 and folds the scales into the scores
    and the output (csrc/decode_attention_mma.cu).
    Same contract as `reference_decode_attention` (1 <= lengths[b] <= S is the caller's to keep: the
    kernel reads slots[b, :lengths[b]] unchecked), which runs instead when `decode_attention_supported`
    is False. On CUDA it is two kernels (the partials, their merge) on the current stream, no host
    synchronisation and no value-dependent shape (CUDA-graph safe); lengths are read on the device, and
    slots past a sequence's length are never read. `chunk` (tokens per split, default `_chunk`'s) is
    for benchmarks.
    Raises ValueError/TypeError on shapes, dtypes or devices that do not fit together.
    """
    if q.dim() != 3 or kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(
            f"need q [B, NH, HD] and kv [2, S, KVH, HD], got {tuple(q.shape)} and {tuple(kv.shape)}"
        )
    b, nh, hd = q.shape
    if kv.shape[3] != hd or nh % kv.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv {tuple(kv.shape)} (head_dim, grouped heads)")
    if slots.dim() != 2 or slots.shape[0] != b or lengths.shape != (b,):
        raise ValueError(
            f"need slots [{b}, S] and lengths [{b}], got {tuple(slots.shape)}, {tuple(lengths.shape)}"
        )
    if slots.dtype != torch.int64 or lengths.dtype != torch.int64:
        raise TypeError("slots and lengths must be int64")
    fp8 = is_fp8(kv)
    if q.dtype != kv.dtype and not fp8:
        raise TypeError(f"q is {q.dtype} but kv is {kv.dtype}")
    if fp8 and (kv_scales is None or kv_scales.shape != (2, kv.shape[2]) or kv_scales.dtype != torch.float32):
        raise ValueError(f"an E4M3 kv needs kv_scales float32 [2, {kv.shape[2]}]")
    if not (q.device == kv.device == slots.device == lengths.device):
        raise ValueError("q, kv, slots and lengths must be on one device")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not decode_attention_supported(q, kv):
        return reference_decode_attention(q, kv, slots, lengths, scale, kv_scales)
    assert _MODULE is not None
    q, slots, lengths = q.contiguous(), slots.contiguous(), lengths.contiguous()
    if fp8:
        assert kv_scales is not None
        if kv_scales.device != q.device or not kv_scales.is_contiguous():
            raise ValueError("kv_scales must be contiguous on kv's device")
        extra_kv: dict[str, int] = {"kv_scales": kv_scales.data_ptr()}
    else:
        extra_kv = {}
    if not kv.is_contiguous():
        raise ValueError("kv must be contiguous (a layer of a KVPool is)")
    kvh, s = kv.shape[2], slots.shape[1]
    if chunk is None:
        chunk = _chunk(b, kvh, s, q.device)
    splits = -(-s // chunk)
    part_acc = torch.empty((b, nh, splits, hd), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((b, nh, splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _MODULE.decode_attention(
        q.data_ptr(),
        kv.data_ptr(),
        kv.shape[1],
        slots.data_ptr(),
        s,
        lengths.data_ptr(),
        b,
        kvh,
        nh // kvh,
        hd,
        _DTYPE_CODES[q.dtype],
        float(scale),
        chunk,
        part_acc.data_ptr(),
        part_ml.data_ptr(),
        out.data_ptr(),
        q.device.index,
        _stream(q.device),
        **extra_kv,
    )
    return out
