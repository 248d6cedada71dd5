"""KV gather / scatter / fused gather-write kernels against the torch reference.

The GPU grid (dtype x page size x fragmentation x T) needs CUDA and the built module and is skipped on
the CPU; the wrapper's argument checks and its torch fallback run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from tandem.csrc import kv_cuda

L, H, D = 3, 2, 64


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if kv_cuda.module() is None:
        pytest.skip(kv_cuda.build_info())


def make_slots(n_tokens: int, page_size: int, num_pages: int, fragmented: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    need = -(-n_tokens // page_size)
    pages = torch.randperm(num_pages, generator=g)[:need] if fragmented else torch.arange(need) + 1
    offsets = torch.arange(page_size)
    return (pages[:, None] * page_size + offsets[None, :]).reshape(-1)[:n_tokens].contiguous()


def random_pool(slots: int, dtype: torch.dtype, device: str, seed: int, d: int = D) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, slots, H, d, generator=g).to(dtype).to(device)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).fill_(0xFF)  # NaN for floats: an unwritten element can never compare equal
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ---- GPU grid ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("n_tokens", [1, 37, 2048])
def test_gather_scatter_match_reference(
    dtype: torch.dtype, page_size: int, fragmented: bool, n_tokens: int
) -> None:
    _need_cuda()
    num_pages = -(-4096 // page_size) + 2
    slots = make_slots(n_tokens, page_size, num_pages, fragmented, seed=n_tokens).cuda()
    pool = random_pool(num_pages * page_size, dtype, "cuda", seed=1)
    out = poisoned((L, 2, n_tokens, H, D), dtype, "cuda")
    kv_cuda.gather(pool, slots, out)
    torch.testing.assert_close(bits(out), bits(torch.index_select(pool, 2, slots)), rtol=0, atol=0)

    dst = poisoned(tuple(pool.shape), dtype, "cuda")
    ref = dst.clone()
    kv_cuda.scatter(out, dst, slots)
    kv_cuda.reference_scatter(out, ref, slots)
    torch.testing.assert_close(bits(dst), bits(ref), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [3, 4, 8])  # 6-, 8- and 16-byte rows per head: narrower vectors
def test_unaligned_rows_use_narrower_vectors(head_dim: int) -> None:
    _need_cuda()
    slots = make_slots(100, 1, 300, True, seed=3).cuda()
    pool = random_pool(300, torch.float16, "cuda", seed=2, d=head_dim)
    out = poisoned((L, 2, 100, H, head_dim), torch.float16, "cuda")
    kv_cuda.gather(pool, slots, out)
    torch.testing.assert_close(bits(out), bits(torch.index_select(pool, 2, slots)), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("fragmented", [False, True])
def test_gather_write_into_peer_pool(fragmented: bool) -> None:
    _need_cuda()
    dst_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    src = random_pool(3000, torch.bfloat16, "cuda:0", seed=4)
    src_slots = make_slots(700, 1, 3000, fragmented, seed=5).cuda()
    dst_slots = make_slots(700, 1, 2000, True, seed=6).cuda()
    dst = poisoned((L, 2, 2000, H, D), torch.bfloat16, dst_dev)
    ref = dst.clone()
    kv_cuda.gather_write(src, src_slots, dst, dst_slots)
    torch.cuda.synchronize()
    kv_cuda.reference_gather_write(src, src_slots, ref, dst_slots)
    torch.testing.assert_close(bits(dst), bits(ref), rtol=0, atol=0)


@pytest.mark.gpu
def test_kernels_run_on_the_current_stream() -> None:
    _need_cuda()
    pool = random_pool(4096, torch.bfloat16, "cuda", seed=7)
    slots = make_slots(2048, 1, 4096, True, seed=8).cuda()
    out = poisoned((L, 2, 2048, H, D), torch.bfloat16, "cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        kv_cuda.gather(pool, slots, out)
        ref = torch.index_select(pool, 2, slots)
    s.synchronize()
    assert torch.equal(bits(out), bits(ref))


# ---- everywhere: the checks and the fallback ---------------------------------------------------------


def test_cpu_fallback_matches_reference() -> None:
    slots = make_slots(50, 16, 10, True, seed=9)
    pool = random_pool(160, torch.bfloat16, "cpu", seed=10)
    out = poisoned((L, 2, 50, H, D), torch.bfloat16, "cpu")
    kv_cuda.gather(pool, slots, out)
    assert torch.equal(bits(out), bits(torch.index_select(pool, 2, slots)))
    dst = torch.zeros_like(pool)
    kv_cuda.scatter(out, dst, slots)
    assert torch.equal(bits(torch.index_select(dst, 2, slots)), bits(out))
    assert not kv_cuda.uses_kernels(pool)


@pytest.mark.parametrize(
    ("mutate", "exc", "match"),
    [
        (lambda p, s, o: (p, s, o.to(torch.float16)), TypeError, "staging is torch.float16"),
        (lambda p, s, o: (p, s.to(torch.int32), o), TypeError, "int64"),
        (lambda p, s, o: (p, s + 1000, o), ValueError, "outside the pool"),
        (lambda p, s, o: (p, s, o[:, :, :-1]), ValueError, "expected"),
        (lambda p, s, o: (p.transpose(3, 4), s, o), ValueError, "contiguous"),
        (lambda p, s, o: (p[0], s, o), ValueError, r"\[L, 2, S"),
    ],
)
def test_bad_arguments_raise_clear_errors(mutate, exc, match) -> None:  # type: ignore[no-untyped-def]
    slots = make_slots(20, 1, 64, True, seed=11)
    pool = random_pool(64, torch.bfloat16, "cpu", seed=12)
    out = torch.empty(L, 2, 20, H, D, dtype=torch.bfloat16)
    p, s, o = mutate(pool, slots, out)
    with pytest.raises(exc, match=match):
        kv_cuda.gather(p, s, o)


def test_gather_write_rejects_mismatched_pools() -> None:
    a = random_pool(64, torch.bfloat16, "cpu", seed=13)
    b = random_pool(64, torch.float16, "cpu", seed=14)
    s = torch.arange(4)
    with pytest.raises(TypeError, match=r"dst_pool is torch\.float16"):
        kv_cuda.gather_write(a, s, b, s)
    with pytest.raises(ValueError, match="source slots"):
        kv_cuda.gather_write(a, s, a.clone(), s[:3])


def test_build_info_names_the_module() -> None:
    assert "_cuda_kernels" in kv_cuda.build_info()
