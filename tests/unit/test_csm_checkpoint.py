"""A Sesame CSM checkpoint as transformers saves it loads into the project's two decoders, whose
logits equal transformers' forward on the same weights; a checkpoint whose parts disagree is refused
naming the field.

Tolerance 1e-4 (absolute and relative, float32 on both sides, logits of std ~1-5): the two sides
run the same maths in a different order (summed embeddings, fused q/k/v, paged attention's
reductions), which moves float32 results by ~1e-6 relative per layer; 1e-4 is far below any real
difference (a wrong RoPE position, codebook or head moves logits by O(1)).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import csm_shape, load_csm
from tests.support.csm import CODEBOOKS, TEXT_VOCAB, VOCAB, write_csm

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def _prompt(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [T, N+1] of a context utterance (text rows, audio rows) and the next one's text, and the
    mask of which rows are audio."""
    g = torch.Generator().manual_seed(seed)
    kinds = [False] * 5 + [True] * 6 + [False] * 4  # text, the reference's frames, text
    rows = torch.full((len(kinds), CODEBOOKS + 1), ABSENT, dtype=torch.long)
    audio = torch.tensor(kinds)
    rows[~audio, CODEBOOKS] = torch.randint(0, TEXT_VOCAB, (int((~audio).sum()),), generator=g)
    rows[audio, :CODEBOOKS] = torch.randint(0, VOCAB - 3, (int(audio.sum()), CODEBOOKS), generator=g)
    return rows, audio


def _hf_embeds(model: torch.nn.Module, rows: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    """transformers' own input embeddings of the same positions: `embed_text_tokens` for a text
    position, the backbone's codebook embedding (summed over codebooks) for an audio one, as
    `CsmForConditionalGeneration._merge_input_ids_with_input_values` assembles them."""
    text = model.embed_text_tokens(rows[:, CODEBOOKS].clamp(min=0))
    frames = model.backbone_model.embed_tokens(rows[None, :, :CODEBOOKS].clamp(min=0))[0]
    return torch.where(audio[:, None], frames, text)[None]


def _pool(layout: object) -> KVPool:
    pool = KVPool(layout, num_pages=32, page_size=4, device="cpu")  # type: ignore[arg-type]
    pool.free(pool.allocate(32)[::2])  # fragmented pages
    return pool


@torch.no_grad()
def test_backbone_and_depth_logits_equal_transformers(tmp_path: Path) -> None:
    model = write_csm(tmp_path, seed=3)
    csm = load_csm(tmp_path)
    assert csm.backbone.cfg.row_width == CODEBOOKS + 1 and csm.shape.tied_tables
    assert csm.depth.model.embed_tokens.table.weight is csm.backbone.model.embed_tokens.audio.weight
    rows, audio = _prompt(7)
    g = torch.Generator().manual_seed(11)
    frames = torch.randint(0, VOCAB - 3, (3, CODEBOOKS), generator=g)
    steps = torch.cat([frames, torch.full((3, 1), ABSENT)], dim=1)  # generated frames: no text
    seq, seq_audio = torch.cat([rows, steps]), torch.cat([audio, torch.ones(3, dtype=torch.bool)])

    pool = _pool(csm.backbone.kv_layout())
    slots = pool.slots(pool.allocate(pool.pages_for(len(seq))), len(seq))
    t = len(rows)
    hidden = csm.backbone.prefill_hidden(pool, [_item(rows, slots[:t])])
    ours = [(csm.backbone.head_logits(hidden)[0, 0], hidden[0])]
    for pos in range(t, len(seq)):
        h = csm.backbone.decode_step_hidden(seq[pos : pos + 1], pool, [slots[: pos + 1]], torch.tensor([pos]))
        ours.append((csm.backbone.head_logits(h)[0, 0], h[0]))
    for i, (logits, h) in enumerate(ours):
        n = t + i
        ref = model(inputs_embeds=_hf_embeds(model, seq[:n], seq_audio[:n]), output_hidden_states=True)
        assert ref.logits[0, -1].abs().max() > 0.5  # not a comparison of near-zero logits
        torch.testing.assert_close(logits, ref.logits[0, -1], atol=TOL, rtol=TOL)
        torch.testing.assert_close(h, ref.hidden_states[-1][0, -1], atol=TOL, rtol=TOL)

    # The depth decoder of one frame: position 0 the backbone's hidden state, then codebooks 0..N-2.
    h = ours[-1][1][None]
    codes = frames[0]
    ref = model.depth_decoder(input_ids=torch.cat([torch.zeros(1, dtype=torch.long), codes[:-1]])[None],
                              backbone_last_hidden_state=h).logits[0]  # fmt: skip
    dpool = _pool(csm.depth.kv_layout())
    dslots = dpool.slots(dpool.allocate(dpool.pages_for(CODEBOOKS)), CODEBOOKS)
    first = csm.depth.prefill_hidden(
        dpool, [_item(csm.depth.depth_rows(0, codes[:1]), dslots[:2], csm.depth.project(h))]
    )
    got = [csm.depth.codebook_logits(first, 1)[0, 0]]
    for k in range(2, CODEBOOKS):
        step = csm.depth.decode_step_hidden(
            csm.depth.depth_rows(k - 1, codes[k - 1 : k]), dpool, [dslots[: k + 1]], torch.tensor([k])
        )
        got.append(csm.depth.codebook_logits(step, k)[0, 0])
    assert ref.shape == (CODEBOOKS - 1, VOCAB) and ref.abs().max() > 0.5
    torch.testing.assert_close(torch.stack(got), ref, atol=TOL, rtol=TOL)


def _item(rows: torch.Tensor, slots: torch.Tensor, embeds: torch.Tensor | None = None) -> object:
    from tandem.backend.model.decoder import PrefillItem

    return PrefillItem(rows, slots, 0, embeds)


def test_untied_tables_load_each_their_own(tmp_path: Path) -> None:
    model = write_csm(tmp_path, seed=4, tie_codebooks_embeddings=False)
    csm = load_csm(tmp_path)
    assert not csm.shape.tied_tables
    table = csm.depth.model.embed_tokens.table.weight
    assert table is not csm.backbone.model.embed_tokens.audio.weight
    torch.testing.assert_close(table, model.depth_decoder.model.embed_tokens.weight.detach())


_DEPTH = "depth_decoder_config"


@pytest.mark.parametrize(
    ("part", "key", "value", "field"),
    [
        (_DEPTH, "num_codebooks", CODEBOOKS - 1, "depth_decoder_config.num_codebooks"),
        (_DEPTH, "backbone_hidden_size", 32, "depth_decoder_config.backbone_hidden_size"),
        (_DEPTH, "vocab_size", VOCAB + 1, "depth_decoder_config.vocab_size"),
        (_DEPTH, "max_position_embeddings", 4, "depth_decoder_config.max_position_embeddings"),
        (_DEPTH, "hidden_act", "gelu", "hidden_act"),
        ("codec_config", "num_quantizers", CODEBOOKS - 1, "codec_config.num_quantizers"),
        ("", _DEPTH, None, "depth_decoder_config"),
        ("", "codebook_eos_token_id", VOCAB, "codebook_eos_token_id"),
        ("", "model_type", "llama", "model_type"),
    ],
)
def test_parts_that_disagree_are_refused_by_field(
    tmp_path: Path, part: str, key: str, value: object, field: str
) -> None:
    write_csm(tmp_path, seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    (config[part] if part else config)[key] = value
    with pytest.raises(ValueError, match=re.escape(field)):
        csm_shape(config)


def test_a_misshapen_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_csm(tmp_path, seed=2)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "depth_decoder.codebooks_head.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(name)):
        load_csm(tmp_path)
