"""Llama 3 RoPE scaling: the frequency table equals transformers', and checkpoints with that scaling
give transformers' logits (fp32, 1e-4) in prefill and paged decode, in both config spellings.

The scaling's `original_max_position_embeddings` is set small (32) so that, with head_dim 16, the
table has frequencies in all three bands (unchanged, blended, divided by the factor) and prompts of a
few dozen positions already rotate through the scaled ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.backend.model.checkpoint import config_from_hf, load_checkpoint, save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.rope import RopeScaling, inv_freq, parse_rope
from tests.support.checkpoints import COMMON, check_prefill_and_decode, hf_reference, scramble

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_llama(tie: bool) -> Any:
    return transformers.LlamaConfig(
        **COMMON, rope_theta=10000.0, rope_scaling=dict(SCALING), tie_word_embeddings=tie
    )


def test_inverse_frequencies_equal_transformers() -> None:
    cfg = hf_llama(tie=False)
    expected, attention_factor = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    assert attention_factor == 1.0  # llama3 leaves cos/sin unscaled: the decoder applies none
    theta, scaling = parse_rope(cfg.to_dict())
    ours = inv_freq(16, theta, scaling, "cpu")
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)
    unscaled = inv_freq(16, theta, None, "cpu")
    # all three bands are exercised: unchanged, blended, divided by the factor
    assert ours[0] == unscaled[0]
    assert torch.allclose(ours[-1], unscaled[-1] / 8.0)
    assert ((ours < unscaled) & (ours > unscaled / 8.0)).any()


@pytest.mark.parametrize("tie", [False, True])
def test_llama3_checkpoint_matches_transformers(tie: bool, tmp_path: Path) -> None:
    model = transformers.LlamaForCausalLM(hf_llama(tie)).eval()
    scramble(model, seed=3)
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert (written.get("rope_parameters") or written.get("rope_scaling"))["rope_type"] == "llama3"
    dec = load_checkpoint(tmp_path)
    assert dec.cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    # 60 positions: past original_max_position_embeddings (32), where the scaled bands differ most
    check_prefill_and_decode(dec, hf_reference(model), prompt_len=50, steps=10)


def test_saved_llama3_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    """`save_checkpoint` writes the transformers < 5 spelling (`rope_scaling` + `rope_theta`); the
    installed transformers reads it back to the same model."""
    cfg = ModelConfig(
        vocab_size=97, row_width=1, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, rope_theta=10000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32),
        tie_word_embeddings=True, rms_norm_eps=1e-5,
    )  # fmt: skip
    dec = Decoder.random(cfg, seed=9)
    scramble(dec, seed=9)
    save_checkpoint(dec, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_scaling"] == SCALING and written["rope_theta"] == 10000.0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    check_prefill_and_decode(dec, hf_reference(model), prompt_len=40, steps=4)
    assert load_checkpoint(tmp_path).cfg == cfg


BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
}


def test_both_spellings_parse_to_the_same_scaling() -> None:
    v4 = config_from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": dict(SCALING)})
    v5 = config_from_hf({**BASE, "rope_parameters": {**SCALING, "rope_theta": 500000.0}})
    assert v4.rope_scaling == v5.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert v4.rope_theta == v5.rope_theta == 500000.0
    legacy_key = {**SCALING, "type": "llama3"}
    del legacy_key["rope_type"]
    assert config_from_hf({**BASE, "rope_scaling": legacy_key}).rope_scaling == v4.rope_scaling
    assert config_from_hf({**BASE, "rope_scaling": None}).rope_scaling is None


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear'"),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0}}, "'dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"rope_scaling": {**SCALING, "factor": "x"}}, "malformed rope_scaling"),
        ({"rope_scaling": {**SCALING, "high_freq_factor": 0.5}}, "high_freq_factor > low_freq_factor"),
        ({"rope_scaling": "llama3"}, "unsupported rope_scaling"),
        (
            {
                "rope_scaling": dict(SCALING),
                "rope_parameters": {**SCALING, "factor": 32.0, "rope_theta": 1.0},
            },
            "different scalings",
        ),
    ],
)
def test_other_scalings_are_refused_by_name(override: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        config_from_hf({**BASE, **override})
