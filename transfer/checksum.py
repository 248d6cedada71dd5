"""KV integrity checksum, computed on the tensor's own device.

P hashes what it sends before the copy, D hashes what landed after DONE; the two must agree
(docs/protocol.md: every transfer is checksummed at P and verified at D). Because it runs on the tensor's
device, a GPU path can verify in place without a host round trip.

Definition (over the raw bytes, viewed as little-endian int64 words w_0..w_{n-1}, tail zero-padded):

    a = Σ w_i                mod 2^64
    b = Σ h(i) · w_i         mod 2^64,  h(i) = (mix(j + 1) | 1) · (fmix64(c + 0x5BD1E995) | 1)
                                        for i = c · 2^20 + j   (a fixed per-position hash)
    checksum = fmix64(a ^ fmix64(b ^ nbytes))

where mix is splitmix64's finaliser (the first factor is a table of 2^20 words, the second one odd
number per 8 MiB chunk, so the table is built once per device).

Deviation from the brief's b = Σ (i+1)·w_i: a linear position weight cannot see a swap of two rows that
are mirror images of each other ([x, y | y, x] -> [y, x | x, y] leaves Σ(i+1)·w unchanged), and such
rows are common in structured test data. Hashing the position keeps the cost (one multiply-add per
word) and catches them. Both lanes are sums in the ring Z/2^64, so the reduction order (CPU threads,
GPU blocks) does not change the result: the checksum is the same on every device for equal bytes.

Entry points:

    kv_checksum(t)                 any contiguous tensor (a staging buffer, a receive region)
    kv_checksum_rows(pool, slots)  a request's rows read in place from a paged pool [L, 2, S, *R],
                                   equal to kv_checksum of the staging buffer [L, 2, T, *R] that
                                   gathering `slots` would fill (what P and D hash when P writes D's
                                   pool pages directly, with no staging buffer in between)

Both run the fused kernel of csrc/kv_checksum.cu (via `tandem.csrc.kv_cuda`) for CUDA tensors when the
module is built and the bytes are 8-byte words from an 8-byte aligned base: one pass at memory speed,
asynchronous on the device's current stream up to the final 24-byte readback. Otherwise, and always
on the CPU, they run the torch code below (`reference_kv_checksum`, `reference_kv_checksum_rows`),
which is also what the tests hold the kernel to.
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_CHUNK_WORDS = 1 << 20  # words per position-weight period (8 MiB of bytes)
_KERNEL_CHUNK_WORDS = 1 << 20  # the kernel's (fixed); tests that shrink _CHUNK_WORDS get the torch path
# Chunks hashed per torch call, by device type (`tandem-bench-checksum`, docs/benchmarks/checksum-*.json).
# CPU: 1 (8 MiB temporaries stay in cache; 8 per call was 2.5x slower). CUDA: 8 (each call is a launch
# and a GIL round trip beside the engine thread; 288 MiB on an H200 took 0.5 ms instead of 1.7 ms
# alone, 0.8 instead of 4.7 ms beside a busy thread). `_GROUP`, when set, overrides (tests, bench).
_DEVICE_GROUP = {"cuda": 8}
_GROUP: int | None = None
_weights_cache: dict[tuple[str, int], torch.Tensor] = {}


def _to_signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


def _fmix64(k: int) -> int:
    k &= _MASK
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK
    k ^= k >> 33
    return k


def _position_weights(device: torch.device) -> torch.Tensor:
    """h(j) for j in [0, _CHUNK_WORDS): an int64 tensor cached per device (8 MiB)."""
    key = (str(device), _CHUNK_WORDS)
    cached = _weights_cache.get(key)
    if cached is not None:
        return cached
    # splitmix64-style mix in wrapping int64 arithmetic; `>>` on int64 is arithmetic, so mask the
    # sign-extended bits to get the logical shift.
    x = torch.arange(1, _CHUNK_WORDS + 1, dtype=torch.int64, device=device)
    x = x * _to_signed(0x9E3779B97F4A7C15)
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _to_signed(0xBF58476D1CE4E5B9)
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _to_signed(0x94D049BB133111EB)
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    x = x | 1
    _weights_cache[key] = x
    return x


def _as_words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's bytes as an int64 word vector (tail zero-padded) and its byte length."""
    flat = t.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    whole = nbytes - nbytes % 8
    body = flat[:whole]
    try:
        words = body.view(torch.int64)
    except RuntimeError:  # storage offset not 8-byte aligned: hash an aligned copy instead
        words = body.clone().view(torch.int64)
    if whole != nbytes:
        tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
        tail[: nbytes - whole] = flat[whole:]
        words = torch.cat([words, tail.view(torch.int64)])
    return words, nbytes


def kv_checksum(t: torch.Tensor) -> int:
    """64-bit checksum of `t`'s raw bytes (see module docstring); `t` must be contiguous.

    Called by the sender once per copy (over its staging buffer) and by the receiver once per DONE
    (over the receive region). Reads `t` only. On CUDA with the kernel
    (`kv_cuda.checksum_tensor_supported`): one pass on the current stream, no temporaries, then a
    blocking 24-byte readback. Otherwise `reference_kv_checksum`.
    """
    if not t.is_contiguous():
        raise ValueError("kv_checksum needs a contiguous tensor (hash the staging buffer, not a view)")
    if t.is_cuda and _CHUNK_WORDS == _KERNEL_CHUNK_WORDS:
        from tandem.csrc import kv_cuda

        if kv_cuda.checksum_tensor_supported(t):
            a, b, _ = kv_cuda.checksum_tensor(t).tolist()
            return _finish(a, b, t.nbytes)
    return reference_kv_checksum(t)


def reference_kv_checksum(t: torch.Tensor) -> int:
    """`kv_checksum` with torch ops on `t`'s device: the reference, and the CPU path.

    Allocates about 3 x `_GROUP` x 8 MiB of temporaries on `t`'s device, freed on return. Blocks until
    the device finishes (one `.item()` per lane at the end). Chunks are hashed `_GROUP` at a time as
    rows of a 2-D view (see `_GROUP`).
    """
    if not t.is_contiguous():
        raise ValueError("kv_checksum needs a contiguous tensor (hash the staging buffer, not a view)")
    words, nbytes = _as_words(t)
    device = words.device
    weights = _position_weights(device)
    n = words.numel()
    a = words.sum()
    b = torch.zeros((), dtype=torch.int64, device=device)
    n_full = n // _CHUNK_WORDS
    if n_full:
        factors = _chunk_factors(device, n_full)
        full = words[: n_full * _CHUNK_WORDS].view(n_full, _CHUNK_WORDS)
        group = _GROUP or _DEVICE_GROUP.get(device.type, 1)
        for g in range(0, n_full, group):
            rows = full[g : g + group]
            b = b + ((rows * weights).sum(dim=1) * factors[g : g + rows.shape[0]]).sum()
    if n_full * _CHUNK_WORDS < n:
        tail = words[n_full * _CHUNK_WORDS :]
        factor = _to_signed(_chunk_factor(n_full))
        b = b + (tail * weights[: tail.numel()]).sum() * factor
    return _finish(int(a.item()), int(b.item()), nbytes)


def rows_checksum_from_lanes(lanes: torch.Tensor, pool: torch.Tensor, n_tokens: int) -> int:
    """The checksum from a kernel's output lanes (`kv_cuda.checksum_rows`, `gather_write_checksum`:
    int64 [3], read back here, which waits for the stream that wrote them) over `n_tokens` rows of a
    `[L, 2, S, *R]` pool: what `kv_checksum_rows` returns for those rows."""
    a, b, skipped = lanes.tolist()
    if skipped:
        raise _out_of_range(skipped // (2 * pool.shape[0]), pool.shape[2])
    return _finish(a, b, _rows_nbytes(pool, n_tokens))


def _finish(a: int, b: int, nbytes: int) -> int:
    """The checksum from its two lanes (any int representatives mod 2^64) and the byte length."""
    return _fmix64((a & _MASK) ^ _fmix64((b & _MASK) ^ nbytes))


def _check_rows(pool: torch.Tensor, slots: torch.Tensor | None) -> int:
    """Raises ValueError/TypeError for a pool or slots `kv_checksum_rows` cannot hash; returns T."""
    if pool.dim() < 4 or pool.shape[1] != 2:
        raise ValueError(f"pool must be [L, 2, S, *row] (layer-major K/V), got shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous (a KVPool's kv is)")
    if slots is None:
        return pool.shape[2]
    if slots.dtype != torch.int64:
        raise TypeError(f"slots must be int64, got {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D tensor, got shape {tuple(slots.shape)}")
    if slots.device != pool.device:
        raise ValueError(f"slots is on {slots.device}, expected the pool's device {pool.device}")
    if not slots.is_contiguous():
        raise ValueError("slots must be contiguous")
    return slots.numel()


def _out_of_range(n_bad: int, n_rows: int) -> ValueError:
    return ValueError(f"slots holds {n_bad} slot(s) outside the pool's [0, {n_rows})")


def kv_checksum_rows(pool: torch.Tensor, slots: torch.Tensor | None = None) -> int:
    """The checksum of a request's KV rows read in place: `kv_checksum(staging)` for the staging buffer
    `[L, 2, T, *R]` that gathering `pool[:, :, slots]` would fill, without building it.

    `pool` is `[L, 2, S, *R]`, contiguous; `slots` an int64 [T] contiguous tensor on the pool's device
    (T may be 0), or None for the whole pool as the staging buffer. On CUDA with the kernel
    (`kv_cuda.checksum_rows_supported`): one pass on the current stream, no temporaries, then a
    blocking 24-byte readback; slots outside `[0, S)` are never read and raise ValueError after it.
    Otherwise `reference_kv_checksum_rows`. Raises ValueError/TypeError on a bad pool or slots.
    """
    n_tokens = _check_rows(pool, slots)
    if pool.is_cuda and _CHUNK_WORDS == _KERNEL_CHUNK_WORDS:
        from tandem.csrc import kv_cuda

        if kv_cuda.checksum_rows_supported(pool):
            return rows_checksum_from_lanes(kv_cuda.checksum_rows(pool, slots), pool, n_tokens)
    return reference_kv_checksum_rows(pool, slots)


def _rows_nbytes(pool: torch.Tensor, n_tokens: int) -> int:
    """Bytes of the staging buffer [L, 2, n_tokens, *R] for this pool."""
    per_token = pool.shape[0] * 2 * pool.element_size()
    for d in pool.shape[3:]:
        per_token *= d
    return per_token * n_tokens


def reference_kv_checksum_rows(pool: torch.Tensor, slots: torch.Tensor | None = None) -> int:
    """`kv_checksum_rows` with torch ops: gather with `index_select`, then `reference_kv_checksum`.

    The reference, and the CPU path. Checks slot bounds first (a device sync on CUDA), so an
    out-of-range slot raises ValueError rather than an index error or a device assert.
    """
    _check_rows(pool, slots)
    if slots is None:
        return reference_kv_checksum(pool)
    if slots.numel():
        lo, hi = int(slots.min().item()), int(slots.max().item())
        if lo < 0 or hi >= pool.shape[2]:
            n_bad = int(((slots < 0) | (slots >= pool.shape[2])).sum().item())
            raise _out_of_range(n_bad, pool.shape[2])
    return reference_kv_checksum(torch.index_select(pool, 2, slots))


def _chunk_factor(chunk_index: int) -> int:
    """The odd per-chunk factor: positions in different chunks get different weights from one table."""
    return _fmix64(chunk_index + 0x5BD1E995) | 1


def _chunk_factors(device: torch.device, n: int) -> torch.Tensor:
    """int64 [n] of `_chunk_factor(i)`, cached per device and grown on demand."""
    key = (str(device), -1)
    cached = _weights_cache.get(key)
    if cached is None or cached.numel() < n:
        size = max(n, 2 * (0 if cached is None else cached.numel()), 64)
        values = [_to_signed(_chunk_factor(i)) for i in range(size)]
        cached = _weights_cache[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return cached[:n]


def format_checksum(value: int) -> str:
    """The wire form of a checksum: 16 lowercase hex digits."""
    return f"{value & _MASK:016x}"
