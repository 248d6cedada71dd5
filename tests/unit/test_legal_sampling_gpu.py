"""On a GPU: sampling over the legal ids and the head's span equal the whole-vocabulary reference, under
the decode step's CUDA graph, with FP8 weights, without a host sync (skipped honestly on the CPU).

The reference is the path every step took before: the head's 156,940 rows and
`sample_whole_vocabulary` (the grammar a mask over the vocabulary). Orpheus-3B's head shape
(hidden 3,072) at batches 1..256, so cuBLAS picks the kernels it picks in production.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tandem.backend.generation.grammar import Grammar
from tandem.backend.generation.orpheus_ids import END_OF_SPEECH as ORPHEUS_END_OF_SPEECH
from tandem.backend.generation.sampling import (
    SamplingParams,
    mark_seen,
    sample_on_device,
    sample_whole_vocabulary,
    step_span,
)
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder

pytestmark = pytest.mark.gpu

BATCHES = [1, 2, 3, 8, 9, 16, 33, 64, 128, 256]


@pytest.fixture(scope="module")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device("cuda", 0)


@pytest.fixture(scope="module")
def orpheus(cuda: torch.device) -> Decoder:
    """Orpheus-3B's shape with two layers: the whole head, a body the graph can capture quickly."""
    return Decoder.random(replace(preset("orpheus-3b-shape"), num_layers=2), cuda, seed=0)


def _streams(b: int, step: int) -> tuple[list[SamplingParams], list[int]]:
    kinds = [
        dict(temperature=0.6, top_p=0.8, repetition_penalty=1.1),  # Orpheus' generation_config
        dict(temperature=0.0),
        dict(temperature=1.0, top_k=50),
        dict(temperature=1.2, top_p=1.0, repetition_penalty=1.3),
    ]
    params = [
        SamplingParams(seed=1000 + i, grammar=Grammar.ORPHEUS, grammar_start=30 + 11 * i, **kinds[i % 4])  # type: ignore[arg-type]
        for i in range(b)
    ]
    return params, [p.grammar_start + 3 * i + step for i, p in enumerate(params)]


@pytest.mark.parametrize("b", BATCHES)
def test_span_head_and_legal_draw_equal_the_whole_vocabulary_draw(orpheus: Decoder, b: int) -> None:
    dev = orpheus.device
    gen = torch.Generator(device=dev).manual_seed(b)
    seen = torch.zeros((b, 1, orpheus.cfg.vocab_size), dtype=torch.bool, device=dev)
    for step in range(6):
        h = torch.randn((b, orpheus.cfg.hidden_size), generator=gen, device=dev).to(torch.bfloat16)
        whole = orpheus.head_logits(h).clone()  # an inference tensor: a copy to boost a column of
        whole[: max(1, b // 8), :, ORPHEUS_END_OF_SPEECH] += 40.0  # some rows end their speech
        params, positions = _streams(b, step)
        span = step_span(params, orpheus.cfg.vocab_size)
        narrow = orpheus.head_logits(h, span).clone()
        narrow[: max(1, b // 8), :, ORPHEUS_END_OF_SPEECH - span.lo] += 40.0
        torch.testing.assert_close(narrow, whole[:, :, span.lo : span.hi], rtol=0, atol=1e-3)
        want = sample_whole_vocabulary(whole, params, positions, seen)
        torch.cuda.set_sync_debug_mode("error")  # the step's sampling must not wait for the device
        try:
            got = sample_on_device(narrow, params, positions, seen, span)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), f"batch {b} step {step}: {(got != want).sum().item()} tokens differ"
        assert (want == ORPHEUS_END_OF_SPEECH).any()
        mark_seen(seen, want)


def test_mixed_batches_on_the_device(orpheus: Decoder) -> None:
    """Grammar rows and grammar-less rows in one step: the whole head, the grammar rows gathered."""
    dev = orpheus.device
    gen = torch.Generator(device=dev).manual_seed(7)
    h = torch.randn((40, orpheus.cfg.hidden_size), generator=gen, device=dev).to(torch.bfloat16)
    logits = orpheus.head_logits(h)
    params, positions = _streams(40, 0)
    params = [
        p if i % 3 else SamplingParams(temperature=0.9, top_p=0.95, seed=i) for i, p in enumerate(params)
    ]
    assert step_span(params, orpheus.cfg.vocab_size).is_whole
    want = sample_whole_vocabulary(logits, params, positions)
    assert torch.equal(sample_on_device(logits, params, positions), want)


@pytest.mark.parametrize("fp8", [False, True])
def test_graphed_step_with_the_span_head_draws_the_reference_tokens(cuda: torch.device, fp8: bool) -> None:
    """The decode step under its CUDA graph, then the head over the grammar's span (bf16 also with FP8
    projections): the logits of the whole head's span columns, and the same tokens."""
    from tandem.backend.model.cuda_graphs import GraphedDecode
    from tandem.backend.model.fp8 import Fp8Unsupported, require_fp8_device

    if fp8:
        try:
            require_fp8_device(cuda, "tandem.model.dtype")
        except Fp8Unsupported as exc:
            pytest.skip(str(exc))
    dec = Decoder.random(replace(preset("orpheus-3b-shape"), num_layers=2), cuda, seed=1)
    if fp8:
        dec.quantize_fp8(weights=True, kv=False)
        assert dec.lm_head is None and dec.model.embed_tokens.weight.dtype == torch.bfloat16
    pool = KVPool(dec.kv_layout(), 1024, 16, cuda)
    pool.randomize(torch.Generator(device=cuda).manual_seed(0))
    graphed = GraphedDecode(dec, pool, max_batch=64, context_step=64)
    for b in (1, 5, 64):
        ctx = torch.randint(1, 120, (b,))
        pages = [pool.allocate(pool.pages_for(int(c) + 1)) for c in ctx]
        tables = [pool.slots(p, int(c) + 1) for p, c in zip(pages, ctx, strict=True)]
        rows = torch.randint(128266, 156938, (b, 1))
        params, positions = _streams(b, 0)
        span = step_span(params, dec.cfg.vocab_size)
        narrow = graphed.decode(rows, tables, ctx, span)
        whole = graphed.decode(rows, tables, ctx)  # the same step again: the same KV lands again
        torch.testing.assert_close(narrow, whole[:, :, span.lo : span.hi], rtol=0, atol=1e-3)
        want = sample_whole_vocabulary(whole, params, positions)
        assert torch.equal(sample_on_device(narrow, params, positions, None, span), want)
        for p in pages:
            pool.free(p)
    assert graphed.failed is None
