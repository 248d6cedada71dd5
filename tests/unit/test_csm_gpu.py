"""CSM's two decoders on a GPU run the fused step (the Triton kernels, the paged decode attention
kernel) and still give transformers' logits and its greedy frames on the same weights and device.

float32 on both sides (matmuls without TF32, torch's default): the fused kernels reduce in another
order than transformers' modules, ~1e-6 relative per layer; 2e-4 is the fused-step bound the
decoder's own GPU tests use (`test_fused_decoder.py`), and greedy frames must be equal.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.csm_checkpoint import load_csm
from tandem.backend.model.csm_frames import generate
from tandem.backend.model.decoder import PrefillItem
from tandem.backend.text.csm import Utterance, prompt_rows
from tandem.csrc import kv_cuda, triton_ops
from tests.support.csm import TEXT_VOCAB, write_csm

TOL = 2e-4


@pytest.mark.gpu
def test_fused_csm_decoders_give_transformers_logits_and_frames(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("transformers")
    # Depth hidden 64 over 4 heads: head_dim 16 like the backbone's, a shape the paged kernel decodes.
    model = write_csm(tmp_path, seed=8, depth_override={"hidden_size": 64}).to("cuda")
    csm = load_csm(tmp_path, device="cuda")
    for dec in (csm.backbone, csm.depth):
        cfg = dec.cfg
        assert dec.fused and triton_ops.available(torch.zeros(1, device="cuda", dtype=cfg.torch_dtype))
        assert kv_cuda.kernel_decodes(
            cfg.torch_dtype, dec.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        )

    text = np.concatenate([[1], np.random.default_rng(0).integers(5, TEXT_VOCAB, 9), [4]]).astype(np.int64)
    rows = torch.from_numpy(prompt_rows([Utterance(text)], csm.shape.rows, csm.shape.codebook_eos))
    pool = KVPool(csm.backbone.kv_layout(), num_pages=8, page_size=16, device="cuda")
    slots = pool.slots(pool.allocate(1), rows.shape[0])
    h = csm.backbone.prefill_hidden(pool, [PrefillItem(rows.cuda(), slots, 0)])
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(text)[None].cuda(), output_hidden_states=True)
    torch.testing.assert_close(
        csm.backbone.head_logits(h)[0, 0], ref.logits[0, -1].float(), atol=TOL, rtol=TOL
    )

    with torch.no_grad():
        expected = model.generate(
            input_ids=torch.from_numpy(text)[None].cuda(),
            attention_mask=torch.ones(1, text.size, dtype=torch.long, device="cuda"),
            max_new_tokens=8,
            do_sample=False,
            depth_decoder_do_sample=False,
        )[0]
    got = generate(csm, rows.cuda(), 8, SamplingParams())
    assert torch.equal(got, expected.cpu())
