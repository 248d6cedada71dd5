"""Paged decode attention (csrc/decode_attention.cu) against its torch reference, and in the decoder.

The GPU grid (dtype x head_dim x group size x lengths x fragmentation) needs CUDA and the built module
and is skipped on the CPU; the wrapper's argument checks, its CPU fallback and the decoder's switch
run everywhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import PRESETS
from tandem.backend.model.decoder import Decoder
from tandem.csrc import kv_cuda

# float32 accumulation in both; the tolerance is the output dtype's rounding.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if kv_cuda.module() is None:
        pytest.skip(kv_cuda.build_info())


def _case(
    batch: int, kv_heads: int, group: int, head_dim: int, s: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, one pool layer kv [2, P, KVH, HD], slots [B, S] (shuffled: fragmented), lengths [B]."""
    g = torch.Generator().manual_seed(seed)
    pool_rows = batch * s + 64
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(dtype).to(device)
    kv = torch.randn(2, pool_rows, kv_heads, head_dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(pool_rows, generator=g)[: batch * s].view(batch, s).to(device)
    lengths = torch.randint(1, s + 1, (batch,), generator=g)
    lengths[0] = s  # one full row, and (for batch > 1) one of length 1
    if batch > 1:
        lengths[1] = 1
    return q, kv, slots, lengths.to(device)


def _float_reference(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    return kv_cuda.reference_decode_attention(q.float(), kv.float(), slots, lengths, scale)


# ---- GPU grid ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize(("batch", "s"), [(1, 17), (5, 300), (3, 2048)])
def test_kernel_matches_reference(dtype: torch.dtype, head_dim: int, group: int, batch: int, s: int) -> None:
    """The grid covers both kernels: the tensor-core default (float16/bfloat16 at head_dim 64/128) and
    its staged fallback (float32, head_dim 256)."""
    _need_cuda()
    q, kv, slots, lengths = _case(batch, 2, group, head_dim, s, dtype, "cuda", seed=batch * s + group)
    assert kv_cuda.decode_attention_supported(q, kv)
    got = kv_cuda.decode_attention(q, kv, slots, lengths, head_dim**-0.5)
    want = _float_reference(q, kv, slots, lengths)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [2, 3, 5, 6, 7])
@pytest.mark.parametrize(("batch", "s", "kv_heads"), [(1, 17, 2), (6, 1000, 8), (2, 4100, 1)])
def test_kernels_take_any_group(
    dtype: torch.dtype, head_dim: int, group: int, batch: int, s: int, kv_heads: int
) -> None:
    """Both kernels (bfloat16 at 64/128: the default; float32 and head_dim 256: the staged fallback) cover
    groups 1..8: Orpheus-3B's 3 and Qwen2.5-0.5B's 7 included."""
    _need_cuda()
    q, kv, slots, lengths = _case(batch, kv_heads, group, head_dim, s, dtype, "cuda", seed=batch + s + group)
    assert kv_cuda.decode_attention_supported(q, kv)
    got = kv_cuda.decode_attention(q, kv, slots, lengths, head_dim**-0.5)
    torch.testing.assert_close(
        got.float(), _float_reference(q, kv, slots, lengths), atol=TOL[dtype], rtol=TOL[dtype]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    ("dtype", "hd"), [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 256)]
)
def test_kernels_over_a_paged_pool(page_size: int, dtype: torch.dtype, hd: int) -> None:
    """Slots as a KVPool hands them out: pages of 1 (every row its own page) or 16, shuffled pages; the
    default kernel (head_dim 128) and the staged fallback (256)."""
    _need_cuda()
    g = torch.Generator().manual_seed(page_size)
    batch, s, kvh, group = 9, 700, 8, 4
    pages_each = -(-s // page_size)
    pages = torch.randperm(batch * pages_each + 3, generator=g)[: batch * pages_each].view(batch, pages_each)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)[None, None, :]).reshape(batch, -1)[:, :s]
    kv = torch.randn(2, (batch * pages_each + 3) * page_size, kvh, hd, generator=g).to(dtype).cuda()
    q = torch.randn(batch, kvh * group, hd, generator=g).to(dtype).cuda()
    lengths = torch.randint(1, s + 1, (batch,), generator=g)
    lengths[0] = s
    slots, lengths = slots.contiguous().cuda(), lengths.cuda()
    got = kv_cuda.decode_attention(q, kv, slots, lengths, hd**-0.5)
    want = _float_reference(q, kv, slots, lengths)
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
def test_kernel_matches_reference_at_the_serving_shape() -> None:
    """The 4B shape at a serving batch: large enough that splits are 256 tokens and every warp of a
    block has tiles (the small grid above runs 32-token splits on an H200)."""
    _need_cuda()
    q, kv, slots, lengths = _case(48, 8, 4, 128, 2048, torch.bfloat16, "cuda", seed=9)
    lengths[2:6] = torch.tensor([256, 257, 512, 1023], device="cuda")  # split and tile boundaries
    assert kv_cuda._chunk(48, 8, 2048, q.device) == 256
    got = kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5)
    torch.testing.assert_close(got.float(), _float_reference(q, kv, slots, lengths), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_kernel_ignores_slots_past_each_length() -> None:
    """Entries past a sequence's length may hold anything (a CUDA graph's padding): never read."""
    _need_cuda()
    q, kv, slots, lengths = _case(4, 8, 4, 128, 512, torch.bfloat16, "cuda", seed=7)
    want = kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5)
    cols = torch.arange(512, device="cuda")
    garbage = torch.where(cols[None, :] < lengths[:, None], slots, torch.full_like(slots, 1 << 40))
    got = kv_cuda.decode_attention(q, kv, garbage, lengths, 128**-0.5)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_kernel_is_graph_capturable() -> None:
    _need_cuda()
    q, kv, slots, lengths = _case(6, 8, 4, 128, 1024, torch.bfloat16, "cuda", seed=3)
    eager = kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5)
    lengths.copy_(torch.tensor([1024, 1, 5, 700, 999, 64], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kv_cuda.decode_attention(q, kv, slots, lengths, 128**-0.5))
    assert not torch.equal(out, eager)  # the replay read the new lengths on the device


def _gpu_decoder(dtype: str) -> Decoder:
    cfg = replace(PRESETS["tiny"], num_heads=8, num_kv_heads=2, head_dim=64, hidden_size=256, dtype=dtype)
    return Decoder.random(cfg, device="cuda", seed=5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_step_same_with_kernel_and_without(dtype: str) -> None:
    """A decode step through the kernel gives the logits of the gather + SDPA path (same KV written)."""
    _need_cuda()
    dec = _gpu_decoder(dtype)
    assert kv_cuda.kernel_decodes(dec.cfg.torch_dtype, dec.device, 8, 2, 64)
    logits = {}
    for paged in (True, False):
        dec.paged_attention = paged
        pool = KVPool(dec.kv_layout(), num_pages=64, page_size=4, device="cuda")
        g = torch.Generator().manual_seed(11)
        tables, positions = [], []
        for n in (9, 30, 1):
            rows = torch.randint(0, dec.cfg.vocab_size, (n, dec.cfg.row_width), generator=g)
            slots = pool.slots(pool.allocate(pool.pages_for(n + 1)), n + 1)
            dec.prefill(rows.cuda(), pool, slots[:n], 0)
            tables.append(slots)
            positions.append(n)
        step = torch.randint(0, dec.cfg.vocab_size, (3, dec.cfg.row_width), generator=g)
        logits[paged] = dec.decode(step.cuda(), pool, tables, torch.tensor(positions))
    tol = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(logits[True], logits[False], atol=tol, rtol=tol)


@pytest.mark.gpu
def test_gpu_prefill_with_prefix_and_kernel_decode_match_full_forward() -> None:
    """On a GPU: prefill in two parts (the second over a cached prefix: the lower-right causal bias) and
    then kernel decode steps give the logits of one pool-free forward over the whole sequence."""
    _need_cuda()
    dec = _gpu_decoder("float32")
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, dec.cfg.vocab_size, (40, dec.cfg.row_width), generator=g).cuda()
    full = dec(seq)
    pool = KVPool(dec.kv_layout(), num_pages=64, page_size=4, device="cuda")
    pages = pool.allocate(pool.pages_for(40))
    pages.reverse()  # fragmented: positions run backwards through the pages
    slots = pool.slots(pages, 40)
    dec.prefill(seq[:13], pool, slots[:13], 0)
    last = dec.prefill(seq[13:30], pool, slots[:30], 13)
    torch.testing.assert_close(last, full[29], atol=1e-4, rtol=1e-4)
    for pos in range(30, 40):
        out = dec.decode(seq[pos : pos + 1], pool, [slots[: pos + 1]], torch.tensor([pos]))
        torch.testing.assert_close(out[0], full[pos], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_prefill_many_matches_each_prompt_alone() -> None:
    """The GPU branch of `prefill_many` (per-head K/V, lower-right causal bias) with several prompts,
    some over a cached prefix, gives each prompt's own full-forward logits."""
    _need_cuda()
    from tandem.backend.model.decoder import PrefillItem

    dec = _gpu_decoder("float32")
    g = torch.Generator().manual_seed(6)
    pool = KVPool(dec.kv_layout(), num_pages=96, page_size=4, device="cuda")
    seqs = [
        torch.randint(0, dec.cfg.vocab_size, (n, dec.cfg.row_width), generator=g).cuda() for n in (9, 21, 4)
    ]
    starts = [0, 12, 3]
    tables = [pool.slots(pool.allocate(pool.pages_for(len(x))), len(x)) for x in seqs]
    for x, st, sl in zip(seqs, starts, tables, strict=True):
        if st:
            dec.prefill(x[:st], pool, sl[:st], 0)
    items = [PrefillItem(x[st:], sl, st) for x, st, sl in zip(seqs, starts, tables, strict=True)]
    logits = dec.prefill_many(pool, items)
    for i, x in enumerate(seqs):
        torch.testing.assert_close(logits[i], dec(x)[-1], atol=1e-4, rtol=1e-4)


# ---- everywhere ----------------------------------------------------------------------------------------


def test_cpu_runs_the_reference() -> None:
    q, kv, slots, lengths = _case(3, 2, 2, 16, 40, torch.float32, "cpu", seed=1)
    assert not kv_cuda.decode_attention_supported(q, kv)
    got = kv_cuda.decode_attention(q, kv, slots, lengths, 0.25)
    assert torch.equal(got, kv_cuda.reference_decode_attention(q, kv, slots, lengths, 0.25))


def test_reference_attends_only_within_each_length() -> None:
    """Row b's output is softmax-weighted V over its first lengths[b] slots, computed by hand."""
    q, kv, slots, lengths = _case(2, 1, 2, 8, 6, torch.float64, "cpu", seed=2)
    got = kv_cuda.reference_decode_attention(q, kv, slots, lengths, 0.5)
    for b in range(2):
        idx = slots[b, : int(lengths[b])]
        k, v = kv[0, idx, 0], kv[1, idx, 0]  # [n, hd]
        for h in range(2):
            w = torch.softmax((k @ q[b, h]) * 0.5, dim=0)
            torch.testing.assert_close(got[b, h], w @ v)


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (lambda a: {**a, "q": a["q"][0]}, ValueError, "need q"),
        (lambda a: {**a, "kv": a["kv"][:, :, :, :8]}, ValueError, "does not fit"),
        (lambda a: {**a, "slots": a["slots"][:2]}, ValueError, "need slots"),
        (lambda a: {**a, "lengths": a["lengths"].int()}, TypeError, "int64"),
        (lambda a: {**a, "q": a["q"].double()}, TypeError, "q is torch.float64"),
        (lambda a: {**a, "chunk": 0}, ValueError, "chunk must be >= 1"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, exc, match) -> None:  # type: ignore[no-untyped-def]
    q, kv, slots, lengths = _case(3, 2, 2, 16, 40, torch.float32, "cpu", seed=1)
    args = change({"q": q, "kv": kv, "slots": slots, "lengths": lengths, "chunk": None})
    with pytest.raises(exc, match=match):
        kv_cuda.decode_attention(
            args["q"], args["kv"], args["slots"], args["lengths"], 0.25, chunk=args["chunk"]
        )


def test_decoder_switch_changes_nothing_on_the_cpu() -> None:
    """On the CPU there is no kernel: the setting is accepted and the torch path runs either way."""
    dec = Decoder.random(PRESETS["tiny"], seed=1)
    assert not kv_cuda.kernel_decodes(dec.cfg.torch_dtype, dec.device, 4, 2, 16)
    out = {}
    for paged in (True, False):
        dec.paged_attention = paged
        pool = KVPool(dec.kv_layout(), num_pages=16, page_size=4, device="cpu")
        slots = pool.slots(pool.allocate(3), 9)
        rows = torch.randint(0, 1024, (8, 4), generator=torch.Generator().manual_seed(0))
        dec.prefill(rows, pool, slots[:8], 0)
        out[paged] = dec.decode(rows[:1], pool, [slots], torch.tensor([8]))
    assert torch.equal(out[True], out[False])
