"""Typed configuration: the decoder's shape, the vocoder's clock, the engines' limits.

Every tunable lives here or in a model's `config.pbtxt` parameters (which are parsed into these
dataclasses by `backend.settings`); nothing else hard-codes a size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.kv.layout import KVLayout
from tandem.backend.model.rope import RopeScaling

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a KV pool may store beside the compute dtypes: E4M3 with per-head scales (backend/model/fp8.py).
_KV_DTYPES = {**_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def kv_torch_dtype(name: str) -> torch.dtype:
    try:
        return _KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; expected one of {sorted(_KV_DTYPES)}") from None


@dataclass(frozen=True)
class ModelConfig:
    """A Llama/Qwen-family decoder over prompt rows of `row_width` ids.

    Column c of a row is embedded with its own table (rows c*V..c*V+V-1 of one [W*V, H] matrix) and
    the W embeddings are summed; the output head is one [W*V, H] matrix whose logits reshape to
    [W, V]. With row_width=1 this is exactly a Hugging Face causal LM.
    """

    vocab_size: int
    row_width: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None  # None: unscaled RoPE; else Llama 3's (backend/model/rope.py)
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    dtype: str = "float32"
    eos_token_id: int | None = None
    name: str = "custom"
    kv_dtype: str = ""  # the KV pool's dtype; "" = `dtype` (`Decoder.quantize_fp8` sets float8_e4m3fn)
    # CSM's rows (backend/model/csm.py): > 0, the last column holds text ids below it, the others codes
    # below vocab_size, and any column may be ABSENT (-1); 0, every column holds ids below vocab_size.
    text_vocab_size: int = 0

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)
        if self.kv_dtype:
            kv_torch_dtype(self.kv_dtype)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if min(self.vocab_size, self.row_width, self.hidden_size, self.num_layers, self.head_dim) < 1:
            raise ValueError("model dimensions must be positive")
        if self.text_vocab_size < 0 or (self.text_vocab_size and self.row_width < 2):
            raise ValueError("text_vocab_size needs rows of codes and a text column (row_width >= 2)")

    @property
    def column_vocab(self) -> tuple[int, ...]:
        """Each column's id bound when they differ (CSM's rows), else () (every column vocab_size)."""
        if not self.text_vocab_size:
            return ()
        return (self.vocab_size,) * (self.row_width - 1) + (self.text_vocab_size,)

    @property
    def min_id(self) -> int:
        """The least id a row may hold: -1 where a column may be absent (CSM's rows), else 0."""
        return -1 if self.text_vocab_size else 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return kv_torch_dtype(self.kv_dtype) if self.kv_dtype else self.torch_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.kv_torch_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def kv_layout(self) -> KVLayout:
        """The KV a decoder built from this config reads and writes, per token (without an E4M3
        layout's scale digest, which only the decoder knows: `Decoder.kv_layout`)."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_torch_dtype)

    def with_dtype(self, dtype: str) -> ModelConfig:
        return replace(self, dtype=dtype)


PRESETS: dict[str, ModelConfig] = {
    # CPU default: streams in milliseconds per step so CI can drive the real server.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=1024,
        row_width=4,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        qk_norm=True,
        max_position_embeddings=8192,
    ),
    # Qwen3-4B's decoder shape: 36 x 2 x 8 x 128 x 2 bytes = 144 KiB of KV per token.
    "qwen3-4b-shape": ModelConfig(
        name="qwen3-4b-shape",
        vocab_size=151936,
        row_width=1,
        hidden_size=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        qk_norm=True,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        dtype="bfloat16",
    ),
    # The shapes TTS users serve (random weights; the head and table are vocab x hidden, tied):
    # Orpheus-3B is Llama-3.2-3B with a 156,940-token vocabulary (text plus SNAC audio codes).
    "orpheus-3b-shape": ModelConfig(
        name="orpheus-3b-shape",
        vocab_size=orpheus.VOCAB_SIZE,
        row_width=1,
        hidden_size=3072,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=8192,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
    # Llasa-1B's decoder: Llama-3.2-1B with its 128,256 text tokens plus XCodec2's 65,536 speech codes.
    "llama-3.2-1b-shape": ModelConfig(
        name="llama-3.2-1b-shape",
        vocab_size=193800,
        row_width=1,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        dtype="bfloat16",
    ),
    # CosyVoice2's and Spark-TTS's LM body: Qwen2.5-0.5B (qkv bias, 14 query heads on 2 KV heads).
    "qwen2.5-0.5b-shape": ModelConfig(
        name="qwen2.5-0.5b-shape",
        vocab_size=151936,
        row_width=1,
        hidden_size=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=4864,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
