"""Checkpoint comparisons against transformers: the tiny shared config, weight scrambling, and a
check that a `Decoder` gives a reference's logits in prefill and step-by-step paged decode."""

from __future__ import annotations

from typing import Any

import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.decoder import Decoder

V = 97
TOL = 1e-4
COMMON: dict[str, Any] = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


def scramble(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def check_prefill_and_decode(dec: Decoder, reference: Any, prompt_len: int = 12, steps: int = 8) -> None:
    """`reference(seq [T, W]) -> logits [W, V]` of the last position, from transformers."""
    w = dec.cfg.row_width
    seq = torch.stack([ids(prompt_len + steps, 100 + c) for c in range(w)], dim=1)
    pool = KVPool(dec.kv_layout(), num_pages=32, page_size=4, device="cpu")
    pool.free(pool.allocate(32)[::2])  # fragmented pages
    slots = pool.slots(pool.allocate(pool.pages_for(len(seq))), len(seq))
    last = dec.prefill(seq[:prompt_len], pool, slots[:prompt_len], 0)
    expected = reference(seq[:prompt_len])
    assert expected.abs().max() > 0.5  # the comparison is not between near-zero logits
    torch.testing.assert_close(last, expected, atol=TOL, rtol=TOL)
    for pos in range(prompt_len, len(seq)):
        out = dec.decode(seq[pos : pos + 1], pool, [slots[: pos + 1]], torch.tensor([pos]))
        torch.testing.assert_close(out[0], reference(seq[: pos + 1]), atol=TOL, rtol=TOL)


def hf_reference(model: torch.nn.Module) -> Any:
    @torch.no_grad()
    def run(seq: torch.Tensor) -> torch.Tensor:
        return model(input_ids=seq[:, 0][None]).logits[0, -1:].float()

    return run
