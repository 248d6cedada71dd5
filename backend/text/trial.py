"""A trial Orpheus-format checkpoint, made here since none can be downloaded offline:
`tandem-repo --trial-orpheus DIR` (cli/make_repository.py) and the tests use it.

- `llama3_tokenizer()`: Llama-3-style, built with the `tokenizers` package: byte-level BPE trained
  on a small corpus and padded to 128,000 regular tokens, Llama 3's 256 special tokens at
  128000-128255 (`<|begin_of_text|>` 128000 added by the post-processor, `<|eot_id|>` 128009),
  then Orpheus' `<custom_token_N>` at 128256 + N up to vocabulary 156,940.
- `orpheus_checkpoint(dir)`: a small random decoder with Orpheus' exact layout (Llama, llama3 RoPE
  scaling as Llama 3.2 ships it, tied embeddings, vocabulary 156,940) saved as config.json +
  safetensors, with that tokenizer.json and a generation_config.json. Its speech is noise (random
  weights): it shows the path text -> tokens -> audio, not a voice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors, trainers
from tokenizers import models as tokenizer_models

from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.rope import RopeScaling

BOS = "<|begin_of_text|>"
LLAMA3_SPECIAL_BASE = 128000
ORPHEUS_VOCAB = orpheus.VOCAB_SIZE
ORPHEUS_VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
END_OF_SPEECH = orpheus.END_OF_SPEECH

_CORPUS = [
    "tara: Hello there, how are you doing today? I am fine, thank you.",
    "leo: The quick brown fox jumps over the lazy dog, again and again.",
    "Speech synthesis turns written text into sound, one token at a time.",
    "Numbers like 1, 22 and 333 and punctuation... also need tokens! Ça va? Grüße.",
]


def bos_processor(bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )


def byte_level(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()


def llama3_specials() -> list[str]:
    """Llama 3's 256 special tokens, in id order from 128000."""
    names = [BOS, "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]
    names += ["<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>"]
    names += ["<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]
    assert len(names) == 256
    return names


def llama3_tokenizer(vocab_size: int = ORPHEUS_VOCAB) -> Tokenizer:
    trainer_tok = Tokenizer(tokenizer_models.BPE())
    byte_level(trainer_tok)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    trainer_tok.train_from_iterator(_CORPUS, trainer=trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    pairs = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    merges: list[tuple[str, str]] = [(str(a), str(b)) for a, b in pairs]
    for i in range(len(vocab), LLAMA3_SPECIAL_BASE):  # regular ids no merge produces
        vocab[f"<|filler_{i}|>"] = i
    tok = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=merges))
    byte_level(tok)
    specials = llama3_specials()
    specials += [f"<custom_token_{n}>" for n in range(vocab_size - LLAMA3_SPECIAL_BASE - 256)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = bos_processor(LLAMA3_SPECIAL_BASE)
    assert (
        tok.get_vocab_size() == vocab_size and tok.token_to_id("<custom_token_3>") == orpheus.START_OF_HUMAN
    )
    return tok


def orpheus_config(**shape: Any) -> ModelConfig:
    """Orpheus' layout at a test size (Orpheus-3B: hidden 3072, 28 layers, 24/8 heads, 8192 MLP)."""
    base: dict[str, Any] = {
        "vocab_size": ORPHEUS_VOCAB,
        "row_width": 1,
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "rope_theta": 500000.0,
        "rope_scaling": RopeScaling(32.0, 1.0, 4.0, 8192),
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
        "dtype": "float32",
        "eos_token_id": orpheus.END_OF_TEXT,
        "name": "orpheus-test",
    }
    return ModelConfig(**{**base, **shape})


def orpheus_checkpoint(path: Path, seed: int = 0, voices: bool = False, **shape: Any) -> Path:
    """Write the Orpheus-layout checkpoint into `path` (created); `voices` lists Orpheus' voices in
    its config.json (`tandem_voices`), so unknown voices are refused."""
    save_checkpoint(Decoder.random(orpheus_config(**shape), seed=seed), path)
    llama3_tokenizer().save(str(path / "tokenizer.json"))
    generation = {
        "bos_token_id": LLAMA3_SPECIAL_BASE,
        "eos_token_id": [END_OF_SPEECH, orpheus.END_OF_TEXT],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.8,
        "repetition_penalty": 1.1,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if voices:
        cfg = json.loads((path / "config.json").read_text())
        cfg["tandem_voices"] = list(ORPHEUS_VOICES)
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path
