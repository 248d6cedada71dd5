"""Decoder on paged KV: prefill/decode agree with a plain full-sequence forward, whatever the page layout,
batch companions or prefix-cache reuse."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.kv.prefix_cache import PrefixCache
from tandem.backend.model.config import PRESETS, ModelConfig
from tandem.backend.model.decoder import Decoder, PrefillItem
from tandem.backend.model.warm_up import warm_up

CFG = dataclasses.replace(PRESETS["tiny"], vocab_size=256, rope_theta=10000.0)
PAGE = 4


@pytest.fixture(scope="module")
def dec() -> Decoder:
    return Decoder.random(CFG, seed=1)


def rows(n: int, seed: int, cfg: ModelConfig = CFG) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (n, cfg.row_width), generator=g)


def fragmented_pool(dec: Decoder, num_pages: int = 64) -> KVPool:
    pool = KVPool(dec.kv_layout(), num_pages=num_pages, page_size=PAGE, device="cpu")
    pool.free(pool.allocate(num_pages)[::2])  # every other page free -> later allocations interleave
    return pool


def test_random_is_deterministic_and_non_degenerate(dec: Decoder) -> None:
    again = Decoder.random(CFG, seed=1)
    other = Decoder.random(CFG, seed=2)
    w = dec.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, again.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.q_proj.weight)
    logits = dec(rows(5, 0))
    assert logits.shape == (5, CFG.row_width, CFG.vocab_size) and logits.dtype == torch.float32
    assert logits.std() > 0.5  # sampling tests need a non-flat distribution
    assert dec.model.norm.weight.eq(1).all()


def test_prefill_then_decode_matches_full_forward(dec: Decoder) -> None:
    seq = rows(19, 1)
    full = dec(seq)
    pool = fragmented_pool(dec)
    t = 11
    pages = pool.allocate(pool.pages_for(len(seq)))
    slots = pool.slots(pages, len(seq))
    last = dec.prefill(seq[:t], pool, slots[:t], start=0)
    torch.testing.assert_close(last, full[t - 1], atol=1e-5, rtol=1e-5)
    for pos in range(t, len(seq)):
        out = dec.decode(seq[pos : pos + 1], pool, [slots[: pos + 1]], torch.tensor([pos]))
        assert out.shape == (1, CFG.row_width, CFG.vocab_size)
        torch.testing.assert_close(out[0], full[pos], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_matches_single_prefill(dec: Decoder) -> None:
    seq = rows(17, 2)
    full = dec(seq)
    pool = fragmented_pool(dec)
    slots = pool.slots(pool.allocate(5), 17)
    dec.prefill(seq[:6], pool, slots[:6], 0)
    dec.prefill(seq[6:13], pool, slots[:13], 6)
    last = dec.prefill(seq[13:], pool, slots, 13)
    torch.testing.assert_close(last, full[-1], atol=1e-5, rtol=1e-5)


def test_fragmented_pages_give_same_logits(dec: Decoder) -> None:
    seq = rows(14, 3)
    contiguous = KVPool(dec.kv_layout(), num_pages=8, page_size=PAGE, device="cpu")
    frag = fragmented_pool(dec, 16)
    a_pages, b_pages = contiguous.allocate(4), frag.allocate(4)
    assert b_pages != sorted(b_pages) or b_pages[1] - b_pages[0] != 1
    a = dec.prefill(seq, contiguous, contiguous.slots(a_pages, 14), 0)
    b = dec.prefill(seq, frag, frag.slots(b_pages, 14), 0)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_decode_batch_independent_of_companions(dec: Decoder) -> None:
    pool = fragmented_pool(dec, 128)
    lengths = [3, 17, 9, 1]
    seqs = [rows(n + 1, 10 + i) for i, n in enumerate(lengths)]
    tables = []
    for seq, n in zip(seqs, lengths, strict=True):
        slots = pool.slots(pool.allocate(pool.pages_for(n + 1)), n + 1)
        dec.prefill(seq[:n], pool, slots[:n], 0)
        tables.append(slots)
    new_rows = torch.stack([seq[-1] for seq in seqs])
    positions = torch.tensor(lengths)
    batched = dec.decode(new_rows, pool, tables, positions)
    for i in range(len(seqs)):
        alone = dec.decode(new_rows[i : i + 1], pool, [tables[i]], positions[i : i + 1])
        torch.testing.assert_close(batched[i], alone[0])
        torch.testing.assert_close(alone[0], dec(seqs[i])[-1], atol=1e-5, rtol=1e-5)
    order = [2, 0, 3, 1]
    shuffled = dec.decode(new_rows[order], pool, [tables[i] for i in order], positions[order])
    torch.testing.assert_close(shuffled, batched[order])


def test_prefix_cache_reuse_matches_full_prefill(dec: Decoder) -> None:
    pool = KVPool(dec.kv_layout(), num_pages=32, page_size=PAGE, device="cpu")
    cache = PrefixCache(pool)
    first = rows(13, 20)
    alloc = cache.allocate(first, extra_tokens=2)
    dec.prefill(first, pool, pool.slots(alloc.pages, 13), 0)
    cache.commit(alloc, first)
    second = torch.cat([first[:10], rows(5, 21)])
    reuse = cache.allocate(second, extra_tokens=1)
    assert reuse.cached_tokens == 8
    slots = pool.slots(reuse.pages, 16)
    shared_before = pool.kv[:, :, slots[:8]].clone()
    logits = dec.prefill(second[8:], pool, slots[:15], start=8)
    torch.testing.assert_close(logits, dec(second)[-1], atol=1e-5, rtol=1e-5)
    # ...and decode continues correctly on top of the shared pages.
    nxt = rows(1, 22)
    step = dec.decode(nxt, pool, [slots], torch.tensor([15]))
    torch.testing.assert_close(step[0], dec(torch.cat([second, nxt]))[-1], atol=1e-5, rtol=1e-5)
    # The shared (cached) pages were only read, never written, by the second prompt.
    assert torch.equal(pool.kv[:, :, slots[:8]], shared_before)
    cache.release(alloc)
    cache.release(reuse)


def test_prefill_many_matches_each_prompt_alone(dec: Decoder) -> None:
    """Prompts prefilled in one forward (some over a cached prefix, fragmented pages) give each prompt's
    own logits and KV, as if each ran alone: no prompt attends to another's rows."""
    pool = fragmented_pool(dec, 96)
    seqs = [rows(9, 30), rows(21, 31), rows(4, 32)]
    starts = [0, 12, 3]  # the prefixes of prompts 1 and 2 are already in the pool
    tables = [pool.slots(pool.allocate(pool.pages_for(len(q) + 1)), len(q) + 1) for q in seqs]
    for q, st, slots in zip(seqs, starts, tables, strict=True):
        if st:
            dec.prefill(q[:st], pool, slots[:st], 0)
    items = [PrefillItem(q[st:], sl[: len(q)], st) for q, st, sl in zip(seqs, starts, tables, strict=True)]
    logits = dec.prefill_many(pool, items)
    assert logits.shape == (3, CFG.row_width, CFG.vocab_size)
    for i, q in enumerate(seqs):
        torch.testing.assert_close(logits[i], dec(q)[-1], atol=1e-5, rtol=1e-5)
        nxt = rows(1, 40 + i)  # decoding on top shows the KV each prompt left is its own
        step = dec.decode(nxt, pool, [tables[i]], torch.tensor([len(q)]))
        torch.testing.assert_close(step[0], dec(torch.cat([q, nxt]))[-1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        dec.prefill_many(pool, [])
    with pytest.raises(ValueError, match="no rows"):
        dec.prefill_many(pool, [PrefillItem(seqs[0][:0], tables[0][:0], 0)])


def test_variants_and_bfloat16() -> None:
    variants = [
        dataclasses.replace(CFG, qk_norm=False, attention_bias=True, tie_word_embeddings=True, row_width=1),
        dataclasses.replace(CFG, num_kv_heads=4, dtype="bfloat16"),
    ]
    for cfg in variants:
        dec = Decoder.random(cfg, seed=3)
        assert dec.model.embed_tokens.weight.dtype == cfg.torch_dtype
        seq = rows(9, 4, cfg)
        pool = KVPool(dec.kv_layout(), num_pages=8, page_size=PAGE, device="cpu")
        slots = pool.slots(pool.allocate(3), 9)
        last = dec.prefill(seq[:8], pool, slots[:8], 0)
        step = dec.decode(seq[8:], pool, [slots], torch.tensor([8]))
        full = dec(seq)
        tol = 1e-5 if cfg.dtype == "float32" else 0.1
        assert last.dtype == torch.float32 and torch.isfinite(step).all()
        torch.testing.assert_close(last, full[7], atol=tol, rtol=tol)
        torch.testing.assert_close(step[0], full[8], atol=tol, rtol=tol)


def test_rejects_mismatched_pool_and_rows(dec: Decoder) -> None:
    other = KVPool(Decoder.random(dataclasses.replace(CFG, num_layers=1)).kv_layout(), 4, PAGE, "cpu")
    with pytest.raises(ValueError):
        dec.prefill(rows(3, 0), other, torch.arange(3), 0)
    pool = KVPool(dec.kv_layout(), 4, PAGE, "cpu")
    with pytest.raises(ValueError):
        dec.prefill(rows(3, 0)[:, :1], pool, torch.arange(3), 0)
    with pytest.raises(ValueError):
        dec.prefill(rows(3, 0), pool, torch.arange(4), 0)


def test_warm_up_is_a_no_op_on_the_cpu() -> None:
    """Nothing compiles on a CPU: `warm_up` runs nothing and leaves the pool as it was."""
    dec = Decoder.random(PRESETS["tiny"])
    pool = KVPool(dec.kv_layout(), num_pages=8, page_size=4, device="cpu")
    assert warm_up(dec, pool) == 0.0 and pool.num_free_pages == 8
