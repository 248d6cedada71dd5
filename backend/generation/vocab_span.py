"""`VocabSpan`: the contiguous ids whose logits a step computes.

The output head is the largest single read of a decode step (Orpheus-3B: 156,940 x 3,072 bf16, 0.96
GB), and every per-vocabulary pass of the sampler scales with its width. A stream under an audio-token
grammar can only emit ids of a small range (`grammar.span`), so a step whose every stream has a grammar
computes the head's rows of that range alone; a step with one stream without a grammar computes them
all (`step_span`). The sampler receives the span with the logits, so a column keeps its global id.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VocabSpan:
    """Ids lo .. hi - 1 of a vocabulary of `vocab_size` ids: logits column c is id lo + c."""

    lo: int
    hi: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= self.vocab_size:
            raise ValueError(f"a span needs 0 <= lo < hi <= vocab_size, got {self}")

    @classmethod
    def whole(cls, vocab_size: int) -> VocabSpan:
        return cls(0, vocab_size, vocab_size)

    @property
    def width(self) -> int:
        return self.hi - self.lo

    @property
    def is_whole(self) -> bool:
        return self.lo == 0 and self.hi == self.vocab_size

    def covers(self, other: VocabSpan) -> bool:
        return self.vocab_size == other.vocab_size and self.lo <= other.lo and other.hi <= self.hi

    def union(self, other: VocabSpan) -> VocabSpan:
        if self.vocab_size != other.vocab_size:
            raise ValueError(f"spans of vocabularies {self.vocab_size} and {other.vocab_size}")
        return VocabSpan(min(self.lo, other.lo), max(self.hi, other.hi), self.vocab_size)
