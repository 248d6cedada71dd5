"""`kv_checksum_rows`: the KV checksum of a request's rows read in place by slot.

It must equal `kv_checksum` of the staging buffer a gather by the same slots would fill, on every
device and path. The CPU tests hold the torch path to that and to an independent numpy model of the
definition that indexes words the way the kernel does (wire position from (lt, t, k), bytes from the
slot's row). The GPU tests (`gpu`; skipped without CUDA and the built module) hold the kernel
(csrc/kv_checksum.cu) to the torch reference and to the CPU value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.csrc import kv_cuda
from tandem.transfer import checksum as ck
from tandem.transfer.checksum import (
    kv_checksum,
    kv_checksum_rows,
    reference_kv_checksum,
    reference_kv_checksum_rows,
)

CHUNK = 1 << 20  # words per position-weight chunk (transfer/checksum.py's _CHUNK_WORDS)
U64 = np.uint64


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if kv_cuda.module() is None:
        pytest.skip(kv_cuda.build_info())


def make_pool(layers: int, slots: int, row: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits (not random floats: every byte pattern, NaNs included, must hash by its bytes)."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.tensor([], dtype=dtype).element_size()
    n = layers * 2 * slots * int(np.prod(row)) * elem
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(layers, 2, slots, *row)


def shuffled_slots(n_tokens: int, pool_slots: int, seed: int) -> torch.Tensor:
    """Fragmented (page size 1) and out of order: every token's row is somewhere else."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(pool_slots, generator=g)[:n_tokens].contiguous()


def gathered(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return torch.index_select(pool, 2, slots)


# ---- an independent model of the definition, in numpy uint64 (wrapping) ------------------------------


def _np_fmix(k: np.ndarray) -> np.ndarray:
    k = k ^ (k >> U64(33))
    k = k * U64(0xFF51AFD7ED558CCD)
    k = k ^ (k >> U64(33))
    k = k * U64(0xC4CEB9FE1A85EC53)
    return k ^ (k >> U64(33))


def _np_weight(i: np.ndarray) -> np.ndarray:
    j = i & U64(CHUNK - 1)
    c = i >> U64(20)
    x = (j + U64(1)) * U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> U64(27))) * U64(0x94D049BB133111EB)
    x = (x ^ (x >> U64(31))) | U64(1)
    return x * (_np_fmix(c + U64(0x5BD1E995)) | U64(1))


def model_rows_checksum(pool: torch.Tensor, slots: torch.Tensor | None) -> int:
    """The kernel's indexing in numpy: word k of wire row (lt, t) is read from row slots[t] of layer-plane
    lt, and weighted by its wire position i = (lt * T + t) * row_words + k."""
    num_lt, s = pool.shape[0] * 2, pool.shape[2]
    words = pool.contiguous().reshape(-1).view(torch.uint8).numpy().view("<u8").reshape(num_lt, s, -1)
    idx = np.arange(s) if slots is None else slots.numpy()
    rows = words[:, idx, :]  # [num_lt, T, row_words], wire order
    flat = rows.reshape(-1).astype(U64)
    i = np.arange(flat.size, dtype=U64)
    with np.errstate(over="ignore"):
        a = int(flat.sum(dtype=U64))
        b = int((_np_weight(i) * flat).sum(dtype=U64))
    return ck._finish(a, b, flat.size * 8)


# ---- CPU: the definition ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "row",
    [(2, 64), (1, 4), (3, 2), (4, 3)],  # 2-byte dtypes: 256, 8, 12, 24 B; fp32: 512, 16, 24, 48 B rows
)
@pytest.mark.parametrize("n_tokens", [1, 37])
def test_rows_equal_checksum_of_gathered_staging(
    dtype: torch.dtype, row: tuple[int, int], n_tokens: int
) -> None:
    pool = make_pool(3, 64, row, dtype, seed=n_tokens)
    slots = shuffled_slots(n_tokens, 64, seed=7)
    want = kv_checksum(gathered(pool, slots))
    assert kv_checksum_rows(pool, slots) == want
    if pool[0, 0, 0].nbytes % 8 == 0:  # the model (like the kernel) takes rows of whole words only
        assert model_rows_checksum(pool, slots) == want


def test_rows_cross_the_chunk_boundary() -> None:
    """T large enough that the wire buffer spans three 8 MiB chunks, with rows of 6 words (2^20 is not a
    multiple of 6, so rows straddle each boundary): the per-chunk factor and the row/chunk alignment
    both matter, and the numpy model agrees with the torch path."""
    row = (3, 4)  # fp32: 48-byte rows, 6 words
    pool = make_pool(2, 1 << 17, row, torch.float32, seed=11)  # 4 x 131072 rows x 6 words ~ 3.1 M words
    slots = shuffled_slots(120_000, 1 << 17, seed=12)
    want = kv_checksum(gathered(pool, slots))
    assert kv_checksum_rows(pool, slots) == want
    assert model_rows_checksum(pool, slots) == want
    assert 2 * CHUNK < 4 * 120_000 * 6


def test_slots_none_hashes_the_whole_pool_as_staging() -> None:
    pool = make_pool(2, 40, (2, 8), torch.bfloat16, seed=3)
    assert kv_checksum_rows(pool) == kv_checksum(pool) == model_rows_checksum(pool, None)
    assert kv_checksum_rows(pool, torch.arange(40)) == kv_checksum(pool)


def test_empty_slots_hash_the_empty_staging_buffer() -> None:
    pool = make_pool(2, 8, (2, 8), torch.float16, seed=4)
    empty = torch.empty(0, dtype=torch.int64)
    assert kv_checksum_rows(pool, empty) == kv_checksum(gathered(pool, empty))


def test_repeated_slots_hash_each_occurrence() -> None:
    pool = make_pool(1, 8, (1, 8), torch.float32, seed=5)
    slots = torch.tensor([3, 3, 0, 3])
    assert kv_checksum_rows(pool, slots) == kv_checksum(gathered(pool, slots))


# ---- CPU: sensitivity ------------------------------------------------------------------------------------


def test_a_changed_byte_in_a_selected_row_changes_it_and_elsewhere_does_not() -> None:
    pool = make_pool(2, 32, (2, 8), torch.float16, seed=6)
    slots = shuffled_slots(10, 32, seed=8)
    base = kv_checksum_rows(pool, slots)
    flat = pool.view(-1).view(torch.uint8)
    row_bytes = 2 * 8 * 2
    selected = int(slots[4])
    unselected = next(s for s in range(32) if s not in set(slots.tolist()))
    for lt, byte in ((0, 0), (3, row_bytes - 1), (2, 7)):
        y = pool.clone()
        y.view(-1).view(torch.uint8)[(lt * 32 + selected) * row_bytes + byte] ^= 0x01
        assert kv_checksum_rows(y, slots) != base, (lt, byte)
    y = pool.clone()
    y.view(-1).view(torch.uint8)[unselected * row_bytes] ^= 0x01  # a row the request does not own
    assert kv_checksum_rows(y, slots) == base
    assert flat.numel() == 2 * 2 * 32 * row_bytes


def test_swapped_rows_or_slot_order_change_it() -> None:
    pool = make_pool(2, 32, (2, 8), torch.float32, seed=9)
    slots = shuffled_slots(12, 32, seed=10)
    base = kv_checksum_rows(pool, slots)
    swapped_order = slots.clone()
    swapped_order[[2, 7]] = slots[[7, 2]]
    assert kv_checksum_rows(pool, swapped_order) != base
    swapped_rows = pool.clone()
    a, b = int(slots[2]), int(slots[7])
    swapped_rows[:, :, [a, b]] = pool[:, :, [b, a]]
    assert kv_checksum_rows(swapped_rows, slots) != base
    # Mirror-image rows: a linear position weight would miss this swap, the hashed one does not.
    mirror = torch.zeros(1, 2, 2, 2, dtype=torch.int64)
    mirror[0, 0, 0] = torch.tensor([0x1234, 0x7777])
    mirror[0, 0, 1] = torch.tensor([0x7777, 0x1234])
    assert kv_checksum_rows(mirror, torch.tensor([0, 1])) != kv_checksum_rows(mirror, torch.tensor([1, 0]))


# ---- CPU: bad inputs ------------------------------------------------------------------------------------


def test_bad_pools_raise_value_error() -> None:
    pool = make_pool(2, 16, (2, 8), torch.float16, seed=1)
    slots = torch.arange(4)
    # a strided view of the pool: rows are not where the geometry says -> ValueError "contiguous"
    with pytest.raises(ValueError, match="contiguous"):
        kv_checksum_rows(pool.transpose(3, 4), slots)
    # no K/V axis (a 3-D tensor) -> ValueError naming the expected [L, 2, S, *row]
    with pytest.raises(ValueError, match=r"\[L, 2, S, \*row\]"):
        kv_checksum_rows(pool[0], slots)
    # second axis is not K/V (size 3) -> the same ValueError
    with pytest.raises(ValueError, match=r"\[L, 2, S, \*row\]"):
        kv_checksum_rows(torch.zeros(2, 3, 16, 8), slots)


def test_bad_slots_raise_type_or_value_error() -> None:
    pool = make_pool(2, 16, (2, 8), torch.float16, seed=1)
    # int32 slots -> TypeError naming the dtype
    with pytest.raises(TypeError, match="int64"):
        kv_checksum_rows(pool, torch.arange(4, dtype=torch.int32))
    # 2-D slots -> ValueError "1-D"
    with pytest.raises(ValueError, match="1-D"):
        kv_checksum_rows(pool, torch.arange(4).view(2, 2))
    # a strided (every other) view of the slots -> ValueError "contiguous"
    with pytest.raises(ValueError, match="contiguous"):
        kv_checksum_rows(pool, torch.arange(8)[::2])
    # slots on another device than the pool (meta stands in for one) -> ValueError naming both
    with pytest.raises(ValueError, match="pool's device"):
        kv_checksum_rows(pool, torch.arange(4, device="meta"))


@pytest.mark.parametrize("bad", [-1, 16, 1 << 40])
def test_out_of_range_slots_raise_value_error(bad: int) -> None:
    pool = make_pool(2, 16, (2, 8), torch.float16, seed=1)
    # one slot outside [0, S=16) -> ValueError saying how many and the pool's range, nothing read
    with pytest.raises(ValueError, match=r"1 slot\(s\) outside the pool's \[0, 16\)"):
        kv_checksum_rows(pool, torch.tensor([0, bad, 3]))


def test_kernel_path_is_skipped_where_the_chunk_size_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests shrink `_CHUNK_WORDS` to reach chunk boundaries with small data; the kernel's is fixed,
    so such a setting must route to torch (on the CPU both are torch; the value still matches the model
    with a 64-word chunk)."""
    monkeypatch.setattr(ck, "_CHUNK_WORDS", 64)
    monkeypatch.setattr(ck, "_weights_cache", {})
    pool = make_pool(1, 16, (1, 8), torch.float32, seed=2)
    slots = shuffled_slots(9, 16, seed=3)
    assert kv_checksum_rows(pool, slots) == reference_kv_checksum(gathered(pool, slots).contiguous())


# ---- GPU: the kernel against the torch reference and the CPU value ---------------------------------------


GPU_GRID = [
    # (layers, pool slots, row, dtype, tokens)
    (3, 64, (2, 64), torch.bfloat16, 1),
    (3, 64, (2, 64), torch.float16, 37),
    (3, 64, (2, 64), torch.float32, 64),
    (2, 4096, (8, 128), torch.bfloat16, 2048),  # 2 KiB rows (qwen3-4b), 8 MiB staging: one whole chunk
    (4, 8192, (8, 128), torch.bfloat16, 6000),  # ~47 MiB staging, six chunks
    (2, 1 << 17, (3, 2), torch.float32, 120_000),  # 24-byte rows: multiple of 8, not of 16 (8-byte loads)
    (2, 1 << 17, (3, 4), torch.float32, 120_000),  # 48-byte rows straddling chunk boundaries
    (2, 64, (1, 4), torch.float16, 33),  # 8-byte rows: one word each
    (2, 512, (16, 128), torch.bfloat16, 300),  # 4 KiB rows: two steps of a warp's 32 x 4 vectors
    (3, 256, (5, 36), torch.float32, 200),  # 720-byte rows: 45 vectors, a partial step
]


@pytest.mark.gpu
@pytest.mark.parametrize(("layers", "pool_slots", "row", "dtype", "n_tokens"), GPU_GRID)
def test_kernel_matches_reference_and_cpu(
    layers: int, pool_slots: int, row: tuple[int, int], dtype: torch.dtype, n_tokens: int
) -> None:
    _need_cuda()
    cpu_pool = make_pool(layers, pool_slots, row, dtype, seed=n_tokens)
    cpu_slots = shuffled_slots(n_tokens, pool_slots, seed=n_tokens + 1)
    want = kv_checksum(gathered(cpu_pool, cpu_slots))
    pool, slots = cpu_pool.cuda(), cpu_slots.cuda()
    assert kv_cuda.checksum_rows_supported(pool)
    assert kv_checksum_rows(pool, slots) == want
    assert reference_kv_checksum_rows(pool, slots) == want
    # contiguous slots over a prefix, and the whole pool (flat kernel)
    prefix = torch.arange(n_tokens, device="cuda")
    assert kv_checksum_rows(pool, prefix) == kv_checksum(cpu_pool[:, :, :n_tokens].contiguous())
    assert kv_checksum_rows(pool) == kv_checksum(cpu_pool)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "nbytes",
    [8, 16, 24, 4096, CHUNK * 8, CHUNK * 8 + 8, 3 * CHUNK * 8 - 8, 40 << 20, 5, 8 * CHUNK + 3],
)
@pytest.mark.parametrize("offset", [0, 8, 3])  # 16-aligned, 8-aligned (8-byte loads), unaligned (torch)
def test_kv_checksum_on_cuda_equals_cpu(nbytes: int, offset: int) -> None:
    _need_cuda()
    g = torch.Generator().manual_seed(nbytes + offset)
    raw = torch.randint(0, 256, (nbytes + offset,), dtype=torch.uint8, generator=g)
    cpu = raw[offset:]
    dev = raw.cuda()[offset:]
    assert kv_cuda.checksum_tensor_supported(dev) == (offset % 8 == 0 and nbytes % 8 == 0)
    assert kv_checksum(dev) == kv_checksum(cpu) == reference_kv_checksum(dev)


@pytest.mark.gpu
def test_kernel_out_of_range_slots_raise_and_the_device_survives() -> None:
    _need_cuda()
    pool = make_pool(2, 64, (2, 64), torch.bfloat16, seed=1).cuda()
    slots = torch.tensor([0, 64, 5, -3], device="cuda")
    with pytest.raises(ValueError, match=r"2 slot\(s\) outside the pool's \[0, 64\)"):
        kv_checksum_rows(pool, slots)
    lanes = kv_cuda.checksum_rows(pool, slots).cpu()
    assert int(lanes[2]) == 2 * 2 * 2  # two bad tokens x L*2 rows skipped, none read
    ok = torch.tensor([0, 5], device="cuda")
    assert kv_checksum_rows(pool, ok) == kv_checksum(gathered(pool.cpu(), ok.cpu()))


@pytest.mark.gpu
def test_kernel_runs_on_the_current_stream() -> None:
    """Written on a side stream and hashed there without a sync in between: the hash sees the writes."""
    _need_cuda()
    pool = torch.zeros(4, 2, 4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = shuffled_slots(3000, 4096, seed=2).cuda()
    src = make_pool(4, 4096, (8, 128), torch.bfloat16, seed=3)
    src_gpu = src.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        pool.copy_(src_gpu)
        value = kv_checksum_rows(pool, slots)
    assert value == kv_checksum(gathered(src, slots.cpu()))


@pytest.mark.gpu
def test_empty_and_single_row_on_cuda() -> None:
    _need_cuda()
    pool = make_pool(2, 8, (2, 8), torch.float16, seed=4)
    empty = torch.empty(0, dtype=torch.int64)
    assert kv_checksum_rows(pool.cuda(), empty.cuda()) == kv_checksum(gathered(pool, empty))
    one = torch.tensor([5])
    assert kv_checksum_rows(pool.cuda(), one.cuda()) == kv_checksum(gathered(pool, one))


# ---- GPU: P's fused write-and-hash (kv_cuda.gather_write_checksum) -----------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(("layers", "pool_slots", "row", "dtype", "n_tokens"), GPU_GRID)
@pytest.mark.parametrize("fragmented", [True, False])
def test_fused_write_hashes_exactly_what_it_wrote(
    layers: int, pool_slots: int, row: tuple[int, int], dtype: torch.dtype, n_tokens: int, fragmented: bool
) -> None:
    """The lanes of the fused kernel give kv_checksum_rows of the source rows (= the CPU value of the
    staging buffer), the destination's rows at dst_slots equal the source's, and no other
    destination row changes (the destination is poisoned first)."""
    _need_cuda()
    cpu_pool = make_pool(layers, pool_slots, row, dtype, seed=n_tokens + 7)
    if fragmented:
        cpu_src = shuffled_slots(n_tokens, pool_slots, seed=n_tokens + 8)
        cpu_dst = shuffled_slots(n_tokens, pool_slots, seed=n_tokens + 9)
    else:
        cpu_src = torch.arange(n_tokens)
        cpu_dst = torch.arange(pool_slots - n_tokens, pool_slots)
    want = kv_checksum(gathered(cpu_pool, cpu_src))
    src, src_slots, dst_slots = cpu_pool.cuda(), cpu_src.cuda(), cpu_dst.cuda()
    poison = make_pool(layers, pool_slots, row, dtype, seed=n_tokens + 10).cuda()
    dst = poison.clone()
    assert kv_cuda.gather_write_checksum_supported(src, dst)
    lanes = kv_cuda.gather_write_checksum(src, src_slots, dst, dst_slots)
    assert ck.rows_checksum_from_lanes(lanes, src, n_tokens) == want == kv_checksum_rows(src, src_slots)
    assert torch.equal(dst[:, :, dst_slots].view(torch.uint8), src[:, :, src_slots].view(torch.uint8))
    untouched = torch.ones(pool_slots, dtype=torch.bool, device="cuda")
    untouched[dst_slots] = False
    assert torch.equal(dst[:, :, untouched].view(torch.uint8), poison[:, :, untouched].view(torch.uint8))


@pytest.mark.gpu
def test_fused_write_refuses_what_it_cannot_hash() -> None:
    """Rows of 4 bytes (not whole words): unsupported, and the call says so instead of writing."""
    _need_cuda()
    src = make_pool(1, 8, (1, 2), torch.float16, seed=1).cuda()
    dst = torch.zeros_like(src)
    slots = torch.arange(4, device="cuda")
    assert not kv_cuda.gather_write_checksum_supported(src, dst)
    with pytest.raises(RuntimeError, match="no fused write-and-hash kernel"):
        kv_cuda.gather_write_checksum(src, slots, dst, slots)
    assert not torch.any(dst)
    with pytest.raises(ValueError, match="slot"):  # bounds are checked before anything runs
        kv_cuda.gather_write_checksum(src, slots, dst, torch.tensor([0, 1, 2, 99], device="cuda"))
