"""A checkpoint's own text tokenizer: its `tokenizer.json`, through the `tokenizers` library (Rust,
thread-safe, no model code; transformers is only a dev dependency). Gives the ids the checkpoint was
trained on, BOS included.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer


class TokenizerError(ValueError):
    """The tokenizer file is missing or not a tokenizer; raised at load time, never per request."""


class TextTokenizer:
    """Encodes UTF-8 text to token ids with the tokenizer's own special tokens (its BOS included).

    Built once per model instance (`load`); `encode` may be called from any thread.
    """

    def __init__(self, tokenizer: Tokenizer, source: str) -> None:
        self._tok = tokenizer
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        """Read a `tokenizer.json`; raises TokenizerError naming the file when it cannot."""
        file = Path(path)
        if not file.is_file():
            raise TokenizerError(f"no tokenizer file at {file}")
        try:
            return cls(Tokenizer.from_file(str(file)), str(file))
        except Exception as exc:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"{file} is not a tokenizer.json: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce are < this (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary or added token (e.g. ``<custom_token_3>``), None if it has none."""
        found = self._tok.token_to_id(token)
        return None if found is None else int(found)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as the checkpoint's tokenizer makes them: its post-processor's special
        tokens (Llama 3: `<|begin_of_text|>` first) included."""
        return list(self._tok.encode(text, add_special_tokens=True).ids)
