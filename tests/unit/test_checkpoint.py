"""Real checkpoints: config translation, loading HF-saved models, and logits equal to transformers'.

The reference models are built with transformers' own classes (tiny, fp32, weights scrambled to std 0.1
and non-unit norms so every layer matters), saved with `save_pretrained`, loaded with `load_checkpoint`,
and compared at 1e-4 for prefill and for step-by-step paged decode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.backend.model.checkpoint import config_from_hf, load_checkpoint, save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tests.support.checkpoints import COMMON, V, check_prefill_and_decode, hf_reference, scramble

transformers = pytest.importorskip("transformers")


def hf_checkpoint(kind: str, path: Path, tie: bool = False, shard: bool = False) -> torch.nn.Module:
    if kind == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rope_theta=5000.0, tie_word_embeddings=tie)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=tie)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**COMMON, head_dim=24, rope_theta=1e6, tie_word_embeddings=tie)
        model = transformers.Qwen3ForCausalLM(cfg)
    scramble(model, seed=len(kind))
    model.eval()
    model.save_pretrained(path, max_shard_size="40KB" if shard else "5GB")
    return model


@pytest.mark.parametrize(("kind", "tie"), [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_matches_transformers(kind: str, tie: bool, tmp_path: Path) -> None:
    model = hf_checkpoint(kind, tmp_path, tie=tie)
    dec = load_checkpoint(tmp_path)
    assert dec.cfg.qk_norm == (kind == "qwen3") and dec.cfg.attention_bias == (kind == "qwen2")
    assert dec.cfg.tie_word_embeddings == tie
    assert (dec.lm_head is None) == tie
    check_prefill_and_decode(dec, hf_reference(model))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    model = hf_checkpoint("llama", tmp_path, shard=True)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    dec = load_checkpoint(tmp_path)
    check_prefill_and_decode(dec, hf_reference(model), steps=2)


def test_saved_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    cfg = ModelConfig(
        vocab_size=V, row_width=1, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, qk_norm=True, tie_word_embeddings=True, rope_theta=20000.0,
    )  # fmt: skip
    dec = Decoder.random(cfg, seed=5)
    scramble(dec, seed=5)
    save_checkpoint(dec, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    check_prefill_and_decode(dec, hf_reference(model), steps=3)
    again = load_checkpoint(tmp_path)
    assert again.cfg == cfg
    for (name, a), (_, b) in zip(dec.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("qk_norm", [False, True])
def test_row_width_matches_transformers_on_summed_embeddings(qk_norm: bool, tmp_path: Path) -> None:
    w = 3
    cfg = ModelConfig(
        vocab_size=V, row_width=w, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=96, qk_norm=qk_norm, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    src = Decoder.random(cfg, seed=6)
    scramble(src, seed=6)
    save_checkpoint(src, tmp_path)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["tandem_row_width"] == w and hf_cfg["vocab_size"] == V
    dec = load_checkpoint(tmp_path)
    assert dec.cfg.row_width == w

    hf_cfg.pop("tandem_row_width")
    hf_cfg["vocab_size"] = w * V
    cls, model_cls = (
        (transformers.Qwen3Config, transformers.Qwen3Model)
        if qk_norm
        else (transformers.LlamaConfig, transformers.LlamaModel)
    )
    body = model_cls(cls(**{k: v for k, v in hf_cfg.items() if k != "architectures"})).eval()
    tensors = load_file(str(tmp_path / "model.safetensors"))
    body.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    offsets = torch.arange(w) * V

    @torch.no_grad()
    def reference(seq: torch.Tensor) -> torch.Tensor:
        embeds = embed[seq + offsets].sum(dim=1)  # [T, H]
        h = body(inputs_embeds=embeds[None]).last_hidden_state[0, -1]
        return (head @ h).view(w, V)

    check_prefill_and_decode(dec, reference, steps=6)


LLAMA_JSON: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rope_theta": 500000.0,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
    "eos_token_id": [7, 8],
}


def test_config_from_hf_defaults() -> None:
    cfg = config_from_hf(LLAMA_JSON)
    assert cfg.head_dim == 8 and cfg.num_kv_heads == 4 and cfg.rope_theta == 500000.0
    assert cfg.dtype == "bfloat16" and cfg.eos_token_id == 7 and cfg.row_width == 1
    assert not cfg.qk_norm and not cfg.attention_bias and not cfg.tie_word_embeddings
    v5 = {**LLAMA_JSON, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    del v5["rope_theta"]
    assert config_from_hf(v5).rope_theta == 1234.0
    assert config_from_hf({**LLAMA_JSON, "rope_scaling": {"rope_type": "default"}}).rope_theta == 500000.0
    assert config_from_hf({**LLAMA_JSON, "tandem_row_width": 8}).row_width == 8


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"model_type": "mistral"}, "mistral"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_config_from_hf_rejects_unsupported(override: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        config_from_hf({**LLAMA_JSON, **override})


def test_load_rejects_wrong_tensors(tmp_path: Path) -> None:
    cfg = config_from_hf({**LLAMA_JSON, "torch_dtype": "float32"})
    save_checkpoint(Decoder.random(cfg), tmp_path)
    dec = load_checkpoint(tmp_path, dtype="bfloat16")
    assert dec.model.norm.weight.dtype == torch.bfloat16
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if k != "model.norm.weight"}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_checkpoint(tmp_path)
    save_file({**tensors, "model.extra.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.extra\.weight"):
        load_checkpoint(tmp_path)
