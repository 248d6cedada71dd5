"""Tiny Sesame CSM checkpoints made with transformers' own classes (`CsmForConditionalGeneration`,
`MimiModel`), saved as they ship: what the CSM tests load where nothing can be downloaded.

The shape keeps CSM's structure (a Llama backbone, a smaller Llama depth decoder, Llama-3 RoPE
scaling, Mimi at 24 kHz and 12.5 frames a second) at test size: 8 codebooks of 64 Mimi codes
(vocabulary 67: CSM's 2051 is Mimi's 2048 plus 3), hidden 64 and 32, two layers each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.support.checkpoints import scramble

CODEBOOKS = 8
MIMI_CODES = 64
VOCAB = MIMI_CODES + 3
TEXT_VOCAB = 300
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def mimi_config(**override: Any) -> Any:
    """A small Mimi (24 kHz, hop 1920, 12.5 frames/s, the real strides) with CODEBOOKS quantizers."""
    import transformers

    args: dict[str, Any] = {
        "hidden_size": 32,
        "num_filters": 4,
        "num_residual_layers": 1,
        "codebook_size": MIMI_CODES,
        "codebook_dim": 16,
        "vector_quantization_hidden_dimension": 16,
        "num_quantizers": CODEBOOKS,
        "upsample_groups": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 250,
    }
    return transformers.MimiConfig(**{**args, **override})


def csm_config(depth_override: dict[str, Any] | None = None, **override: Any) -> Any:
    """The tiny CSM config; `depth_override` changes fields of its depth decoder's."""
    import transformers

    depth = {
        "num_codebooks": CODEBOOKS,
        "backbone_hidden_size": 64,
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": CODEBOOKS + 1,
        "rope_parameters": ROPE,
        **(depth_override or {}),
    }
    args: dict[str, Any] = {
        "num_codebooks": CODEBOOKS,
        "vocab_size": VOCAB,
        "text_vocab_size": TEXT_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": ROPE,
        "codebook_pad_token_id": VOCAB - 1,
        "codebook_eos_token_id": 0,
        "bos_token_id": 1,
        "pad_token_id": 2,
        "audio_token_id": 2,
        "audio_eos_token_id": 3,
        "depth_decoder_config": depth,
        "codec_config": mimi_config().to_dict(),
    }
    return transformers.CsmConfig(**{**args, **override})


def randomize_codebooks(model: torch.nn.Module, seed: int) -> None:
    """Give Mimi's codebooks random centroids: transformers initialises them to zero (real ones are
    trained), which would quantise every input to code 0 and decode every code alike."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MimiEuclideanCodebook":
                module.embed_sum.copy_(torch.randn(module.embed_sum.shape, generator=g))
                module.cluster_usage.fill_(1.0)
                module._embed = None


def write_csm(
    path: Path, seed: int = 0, depth_override: dict[str, Any] | None = None, **override: Any
) -> Any:
    """A tiny CSM checkpoint in `path` (the decoders' weights scrambled so every layer matters; Mimi's
    as initialised, its codebooks random); returns the model (eval, float32) for
    reference forwards."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.CsmForConditionalGeneration(csm_config(depth_override, **override))
    scramble(model.backbone_model, seed)
    scramble(model.depth_decoder, seed + 1)
    scramble(model.embed_text_tokens, seed + 2)
    scramble(model.lm_head, seed + 3)
    randomize_codebooks(model.codec_model, seed + 4)
    model.eval()
    model.save_pretrained(path)
    return model


def write_mimi(path: Path, seed: int = 0) -> Any:
    """A tiny Mimi directory (`MimiModel.save_pretrained`); returns the model (eval)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.MimiModel(mimi_config()).eval()
    randomize_codebooks(model, seed)
    model.save_pretrained(path)
    return model
