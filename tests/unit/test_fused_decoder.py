"""The decoder's fused step: q/k/v and gate/up weights in one tensor each (views keep the HF parameters),
and on a GPU the fused GEMMs and Triton kernels give the torch modules' logits."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.checkpoint import load_checkpoint, save_checkpoint
from tandem.backend.model.config import PRESETS, ModelConfig, preset
from tandem.backend.model.decoder import Decoder, PrefillItem
from tandem.backend.model.warm_up import warm_up
from tandem.csrc import kv_cuda, triton_ops

TINY = PRESETS["tiny"]


def _layer0(dec: Decoder):  # type: ignore[no-untyped-def]
    return dec.model.layers[0]


def test_projections_are_views_of_one_fused_weight() -> None:
    dec = Decoder.random(replace(TINY, attention_bias=True), seed=3)
    attn, mlp = _layer0(dec).self_attn, _layer0(dec).mlp
    w, b = attn.qkv_weight()
    assert w.shape == (attn.q_proj.out_features + 2 * attn.k_proj.out_features, TINY.hidden_size)
    assert b is not None
    assert torch.equal(w, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(b, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert attn.q_proj.weight.data_ptr() == w.data_ptr()
    gu = mlp.gate_up_weight()
    assert torch.equal(gu, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    with torch.no_grad():  # an in-place write through the HF parameter is a write into the fused weight
        attn.v_proj.weight.fill_(0.5)
    assert attn.qkv_weight()[0][-attn.v_proj.out_features :].eq(0.5).all()


def test_state_dict_keys_and_values_are_the_unfused_ones(tmp_path) -> None:
    """Checkpoints hold q/k/v and gate/up separately; a saved and loaded decoder gives the same logits."""
    dec = Decoder.random(TINY, seed=4)
    keys = set(dec.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys
    assert not any("qkv" in k or "gate_up" in k for k in keys)
    save_checkpoint(dec, tmp_path / "ckpt")
    again = load_checkpoint(tmp_path / "ckpt")
    rows = torch.randint(0, TINY.vocab_size, (6, TINY.row_width), generator=torch.Generator().manual_seed(0))
    assert torch.equal(dec(rows), again(rows))
    a, b = _layer0(dec).self_attn.qkv_weight(), _layer0(again).self_attn.qkv_weight()
    assert torch.equal(a[0], b[0])


def test_a_moved_parameter_is_fused_again() -> None:
    """`Module.to` gives every parameter its own storage: the next use concatenates them again."""
    dec = Decoder.random(TINY, seed=5)
    want = _layer0(dec).self_attn.qkv_weight()[0].clone()
    dec.to(torch.float64)
    attn = _layer0(dec).self_attn
    assert attn.q_proj.weight.dtype == torch.float64
    w, _ = attn.qkv_weight()
    assert w.dtype == torch.float64
    assert attn.k_proj.weight.data_ptr() == w[attn.q_proj.out_features :].data_ptr()
    torch.testing.assert_close(w, want.double())


def test_cpu_step_is_the_torch_path_whatever_the_switch() -> None:
    """On the CPU `fused` changes nothing (the kernels are GPU-only): greedy tokens stay as they were."""
    dec = Decoder.random(TINY, seed=1)
    out = {}
    for fused in (True, False):
        dec.fused = fused
        pool = KVPool(dec.kv_layout(), num_pages=16, page_size=4, device="cpu")
        slots = pool.slots(pool.allocate(3), 9)
        rows = torch.randint(
            0, TINY.vocab_size, (8, TINY.row_width), generator=torch.Generator().manual_seed(0)
        )
        dec.prefill(rows, pool, slots[:8], 0)
        out[fused] = dec.decode(rows[:1], pool, [slots], torch.tensor([8]))
    assert torch.equal(out[True], out[False])


# ---- GPU ------------------------------------------------------------------------------------------------

SHAPES = {
    # Qwen3-like (qk-norm, no bias), the 4B shape's heads; Llama-like with Orpheus' group of 3; Qwen2-like
    # (qkv bias, group 7, head_dim 64, Qwen2.5-0.5B's heads).
    "qwen3": replace(TINY, num_heads=8, num_kv_heads=2, head_dim=128, hidden_size=256, qk_norm=True),
    "llama-g3": replace(TINY, num_heads=6, num_kv_heads=2, head_dim=128, hidden_size=384, qk_norm=False),
    "qwen2-g7": replace(
        TINY, num_heads=14, num_kv_heads=2, head_dim=64, hidden_size=448, qk_norm=False, attention_bias=True
    ),
}


def _need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if not triton_ops.available(torch.empty(1, device="cuda")):
        pytest.skip("Triton not importable")


def _step_logits(dec: Decoder, fused: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits of 3 prompts, of a prompt continued after a cached prefix and of two prompts in
    one `prefill_many`; one decode step's logits) with the fused step on or off."""
    dec.fused = fused
    pool = KVPool(dec.kv_layout(), num_pages=96, page_size=4, device="cuda")
    g = torch.Generator().manual_seed(seed)
    tables, positions, last = [], [], []
    for n in (9, 30, 1):
        rows = torch.randint(0, dec.cfg.vocab_size, (n, dec.cfg.row_width), generator=g)
        slots = pool.slots(pool.allocate(pool.pages_for(n + 1)), n + 1)
        last.append(dec.prefill(rows.cuda(), pool, slots[:n], 0))
        tables.append(slots)
        positions.append(n)
    slots = pool.slots(pool.allocate(pool.pages_for(15)), 15)
    head, tail = (torch.randint(0, dec.cfg.vocab_size, (n, dec.cfg.row_width), generator=g) for n in (9, 6))
    dec.prefill(head.cuda(), pool, slots[:9], 0)
    last.append(dec.prefill(tail.cuda(), pool, slots, 9))
    items = []
    for n in (5, 12):
        rows = torch.randint(0, dec.cfg.vocab_size, (n, dec.cfg.row_width), generator=g)
        items.append(PrefillItem(rows.cuda(), pool.slots(pool.allocate(pool.pages_for(n)), n), 0))
    last.extend(dec.prefill_many(pool, items))
    step = torch.randint(0, dec.cfg.vocab_size, (3, dec.cfg.row_width), generator=g)
    return torch.stack(last), dec.decode(step.cuda(), pool, tables, torch.tensor(positions))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_gives_the_torch_step_logits(shape: str, dtype: str) -> None:
    _need_gpu()
    cfg: ModelConfig = replace(SHAPES[shape], dtype=dtype)
    dec = Decoder.random(cfg, device="cuda", seed=7)
    assert kv_cuda.kernel_decodes(cfg.torch_dtype, dec.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    fused, torch_path = _step_logits(dec, True, 2), _step_logits(dec, False, 2)
    tol = 2e-4 if dtype == "float32" else 6e-2
    for a, b in zip(fused, torch_path, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fused_greedy_tokens_match_at_the_4b_shape_in_float32() -> None:
    """A real-size layer stack (two layers of the 4B shape) in float32: same argmax every stream."""
    _need_gpu()
    cfg = replace(preset("qwen3-4b-shape"), num_layers=2, dtype="float32")
    dec = Decoder.random(cfg, device="cuda", seed=8)
    fused, torch_path = _step_logits(dec, True, 3), _step_logits(dec, False, 3)
    assert torch.equal(fused[1].argmax(-1), torch_path[1].argmax(-1))
    torch.testing.assert_close(fused[1], torch_path[1], atol=1e-3, rtol=1e-3)


def _compiled_variants() -> int:
    """How many specialisations of the fused Triton kernels are compiled in this process."""
    total = 0
    for fn in (triton_ops._add_rms_norm_kernel, triton_ops._rope_kv_write_kernel, triton_ops._swiglu_kernel):
        caches = getattr(fn, "device_caches", None)
        if caches is not None:  # Triton 3.x: device -> (kernel cache, ...)
            total += sum(len(c[0]) for c in caches.values())
        else:
            total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total


@pytest.mark.gpu
def test_warm_up_compiles_what_later_prompts_need_and_gives_its_pages_back() -> None:
    """After `warm_up` no prompt length or cached-prefix offset compiles a new kernel variant
    (a compile inside the engine loop stalls every stream for seconds), and the pool is as it was."""
    _need_gpu()
    cfg = replace(preset("qwen3-4b-shape"), num_layers=1, dtype="bfloat16")
    dec = Decoder.random(cfg, device="cuda", seed=9)
    pool = KVPool(dec.kv_layout(), num_pages=64, page_size=16, device="cuda")
    free = pool.num_free_pages
    assert warm_up(dec, pool) > 0
    assert pool.num_free_pages == free
    compiled = _compiled_variants()
    g = torch.Generator().manual_seed(1)
    for rows, start in ((2, 0), (33, 0), (48, 0), (300, 0), (5, 3), (32, 16), (1, 7)):
        slots = pool.slots(pool.allocate(pool.pages_for(start + rows)), start + rows)
        prompt = torch.randint(0, cfg.vocab_size, (rows, cfg.row_width), generator=g).cuda()
        dec.prefill(prompt, pool, slots, start)
    assert _compiled_variants() == compiled


@pytest.mark.gpu
def test_warm_up_skips_with_a_warning_when_the_pool_is_too_small(caplog) -> None:
    """A pool without room for the warm-up's pages: no page taken, nothing run, a warning says why."""
    _need_gpu()
    cfg = replace(preset("qwen3-4b-shape"), num_layers=1, dtype="bfloat16")
    dec = Decoder.random(cfg, device="cuda", seed=9)
    pool = KVPool(dec.kv_layout(), num_pages=3, page_size=16, device="cuda")
    with caplog.at_level("WARNING", logger="tandem"):
        assert warm_up(dec, pool) == 0.0
    assert pool.num_free_pages == 3
    assert "kernel warm-up skipped: it needs 4 free KV pages, the pool has 3" in caplog.text
