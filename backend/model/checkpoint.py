"""Load and save decoder checkpoints: a Hugging Face `config.json` plus `*.safetensors`, tensor by
tensor with no renaming (`Decoder`'s parameter names are HF's).

Row width W>1 is the extra config key "tandem_row_width" with embed_tokens and lm_head of [W*V, H];
with W=1 the files are plain HF checkpoints. Anything the decoder does not implement (other
architectures, RoPE scalings but Llama 3's, sliding windows, o_proj or MLP biases, other
activations) is a ValueError naming the field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.backend.model.config import ModelConfig, torch_dtype
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.rope import parse_rope

_SUPPORTED = ("llama", "qwen2", "qwen3")
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def config_from_hf(hf_config: dict[str, Any]) -> ModelConfig:
    """Translate an HF `config.json` dict into a ModelConfig.

    Called by `load_checkpoint` (and by settings code that sizes pools before loading weights).
    Raises ValueError naming the unsupported model_type or field.
    """
    hf = hf_config
    model_type = hf.get("model_type")
    if model_type not in _SUPPORTED:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(_SUPPORTED)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
    if hf.get("mlp_bias", False):
        raise ValueError("unsupported field mlp_bias=true")
    if hf.get("use_sliding_window", False):
        raise ValueError("unsupported field use_sliding_window=true")
    if model_type == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    elif hf.get("attention_bias", False):
        # Llama/Qwen3 attention_bias also adds an o_proj bias, which the decoder does not have.
        raise ValueError(f"unsupported field attention_bias=true for model_type {model_type!r}")
    else:
        attention_bias = False
    heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // heads
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    rope_theta, rope_scaling = parse_rope(hf)
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]),
        row_width=int(hf.get("tandem_row_width", 1)),
        hidden_size=int(hf["hidden_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(hf["intermediate_size"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qk_norm=model_type == "qwen3",
        attention_bias=attention_bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        dtype=dtype,
        eos_token_id=None if eos is None else int(eos),
        name=str(hf.get("_name_or_path") or model_type),
    )


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def load_checkpoint(
    path: str | os.PathLike[str], device: torch.device | str = "cpu", dtype: str | None = None
) -> Decoder:
    """Build a Decoder from a checkpoint directory; the caller owns the returned module.

    Called by the engines at start-up. `dtype` overrides the checkpoint's dtype ("float32", "bfloat16",
    "float16"). Weights are copied shard by shard, tensor by tensor, into preallocated parameters on
    `device`, so peak memory is the model plus one tensor. Missing or unexpected tensors and shape
    mismatches raise ValueError.
    """
    root = Path(path)
    cfg = config_from_hf(json.loads((root / "config.json").read_text()))
    if dtype is not None:
        torch_dtype(dtype)
        cfg = cfg.with_dtype(dtype)
    dec = Decoder(cfg, device)
    params = dict(dec.named_parameters())
    seen: set[str] = set()
    for file in shard_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                if name not in params:
                    raise ValueError(
                        f"unexpected tensor {name!r} in {file.name} (not a {cfg.name} decoder weight)"
                    )
                tensor = f.get_tensor(name)
                target = params[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(
            f"checkpoint {root} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    return dec


def _hf_config(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.qk_norm and cfg.attention_bias:
        raise ValueError("qk_norm with attention_bias has no HF equivalent (qwen3's bias includes o_proj)")
    model_type = "qwen3" if cfg.qk_norm else "qwen2" if cfg.attention_bias else "llama"
    hf: dict[str, Any] = {
        "architectures": [_ARCH[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else cfg.rope_scaling.to_hf(),
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "torch_dtype": cfg.dtype,
        "eos_token_id": cfg.eos_token_id,
        "_name_or_path": cfg.name,
    }
    if model_type == "qwen2":
        del hf["attention_bias"]
    if cfg.row_width > 1:
        hf["tandem_row_width"] = cfg.row_width
    return hf


def save_checkpoint(decoder: Decoder, path: str | os.PathLike[str]) -> None:
    """Write `config.json` + `model.safetensors` (HF names) into directory `path`, creating it.

    Called by tools and tests; the decoder is only read. With row_width 1 the result is a checkpoint
    transformers' Auto classes can load.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(_hf_config(decoder.cfg), indent=2) + "\n")
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in decoder.named_parameters()}
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
