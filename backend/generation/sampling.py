"""Batched, order-independent token sampling.

No running RNG state: each uniform is a hash (splitmix64) of (seed, position, column), so a seeded
stream gets the same tokens whichever engine samples it (P its first row, D the rest) and whatever
shares its batch. Top-k, top-p, temperature and the inverse-CDF draw are vectorised on the logits'
device.

Before the draw: the repetition penalty (HF's and vLLM's rule, over a per-stream `seen` mask on the
device, `mark_seen`) and the stream's audio-token grammar (`grammar.py`), both pure functions of the
stream alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.backend.device import upload
from tandem.backend.generation.grammar import Grammar, allowed

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 means greedy (argmax)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages ids the stream already generated
    grammar: Grammar = Grammar.NONE  # the audio-token grammar the stream samples under
    grammar_start: int = 0  # position of the stream's first generated row (audio position 0)
    stop_token_ids: tuple[int, ...] = ()  # ids that end the stream, besides the model's eos id

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.grammar_start < 0:
            raise ValueError(f"grammar_start must be >= 0, got {self.grammar_start}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    def stops(self, token: int) -> bool:
        """True when `token` (a row's column 0) ends the stream under these parameters."""
        return token in self.stop_token_ids

    def to_wire(self) -> list[Any]:
        """Plain values for JSON and msgpack (P's handoff, the stub -> worker Submit); `from_wire` is
        its inverse. One definition, so no process boundary drops a field."""
        return [
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.repetition_penalty,
            int(self.grammar),
            self.grammar_start,
            list(self.stop_token_ids),
        ]

    @classmethod
    def from_wire(cls, values: Sequence[Any]) -> SamplingParams:
        """Raises ValueError (wrong count or a value out of range) or TypeError (wrong type)."""
        t, p, k, seed, penalty, grammar, grammar_start, stops = values
        return cls(
            temperature=float(t),
            top_p=float(p),
            top_k=int(k),
            seed=int(seed),
            repetition_penalty=float(penalty),
            grammar=Grammar(int(grammar)),
            grammar_start=int(grammar_start),
            stop_token_ids=tuple(int(x) for x in stops),
        )


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: Sequence[int], positions: Sequence[int], width: int) -> np.ndarray:
    """float64 [B, width] in [0, 1): element (b, c) is a pure function of (seeds[b], positions[b], c).

    Used by `sample`; public so tests and other samplers can reproduce a stream's draws.
    """
    s = np.array([v & _MASK64 for v in seeds], dtype=np.uint64)[:, None]
    p = np.array([v & _MASK64 for v in positions], dtype=np.uint64)[:, None]
    c = np.arange(width, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(_splitmix64(s) ^ p) ^ c)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """`sample_on_device(...)` brought to the CPU (waits for the device): LongTensor [B, W] on CPU."""
    return sample_on_device(logits, params, positions, seen).cpu()


def mark_seen(seen: torch.Tensor, rows: torch.Tensor) -> None:
    """Record sampled `rows` LongTensor [B, W] in `seen` Bool [B, W, V] (written), on their device;
    nothing waits for it. Called by the running batch after every step, for the next step's penalty."""
    seen.scatter_(2, rows.to(seen.device)[:, :, None], True)


def processed_logits(
    flat: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None,
    w: int,
) -> torch.Tensor:
    """The float32 logits [B*W, V] after the repetition penalty and the grammar (a new tensor when
    either applies; `flat` is never written)."""
    dev, v = flat.device, flat.shape[1]
    if seen is not None and any(p.penalised for p in params):
        penalty = [p.repetition_penalty for p in params]
        pen = upload(torch.tensor(penalty, dtype=torch.float32).repeat_interleave(w), dev)[:, None]
        hit = seen.reshape(flat.shape)
        flat = torch.where(hit, torch.where(flat > 0, flat / pen, flat * pen), flat)
    for grammar in sorted({p.grammar for p in params} - {Grammar.NONE}):
        audio = [pos - p.grammar_start for p, pos in zip(params, positions, strict=True)]
        member = [p.grammar == grammar for p in params]
        audio_dev = upload(torch.tensor(audio, dtype=torch.long).repeat_interleave(w), dev)
        member_dev = upload(torch.tensor(member, dtype=torch.bool).repeat_interleave(w), dev)
        ok = allowed(grammar, audio_dev, v) | ~member_dev[:, None]
        flat = flat.masked_fill(~ok, float("-inf"))
    return flat


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw a token per (row, column) from float32 logits [B, W, V] -> LongTensor [B, W] on their device
    (the caller's); nothing waits for the device.

    First the repetition penalty over `seen` Bool [B, W, V] (row b's stream's generated ids; None: no
    penalty) and row b's grammar at audio position positions[b] - params[b].grammar_start. Then row b is
    greedy when its temperature is 0, else top-k, top-p (the smallest most-likely set of mass >= top_p),
    temperature and an inverse-CDF draw with the uniform of (seed, positions[b], column). Ties go to the
    lower id everywhere, so top_k=1 or a tiny top_p equals greedy."""
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, W, V], got {tuple(logits.shape)}")
    b, w, v = logits.shape
    if len(params) != b or len(positions) != b:
        raise ValueError(f"{b} logit rows need {b} params and positions")
    if b == 0:
        return torch.empty((0, w), dtype=torch.long, device=logits.device)
    dev = logits.device
    flat = processed_logits(logits.float().reshape(b * w, v), params, positions, seen, w)
    greedy_tok = flat.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy_tok.view(b, w)

    def per_row(values: list[float], dtype: torch.dtype) -> torch.Tensor:
        return upload(torch.tensor(values, dtype=dtype).repeat_interleave(w), dev)[:, None]

    temp = per_row([p.temperature if not p.greedy else 1.0 for p in params], torch.float32)
    top_p = per_row([p.top_p for p in params], torch.float32)
    top_k = per_row([float(p.top_k if p.top_k > 0 else v) for p in params], torch.float32)
    is_greedy = per_row([float(p.greedy) for p in params], torch.float32)[:, 0] > 0
    u = upload(uniforms([p.seed for p in params], positions, w).reshape(b * w, 1), dev, torch.float32)

    sorted_logits, order = torch.sort(flat, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=dev, dtype=torch.float32)[None, :]
    keep = rank < top_k
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep &= (mass_before < top_p) | (rank == 0)
    scaled = (sorted_logits / temp).masked_fill(~keep, float("-inf"))
    cdf = torch.cumsum(torch.softmax(scaled, dim=-1), dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    pick = torch.minimum(pick, keep.sum(dim=-1, keepdim=True) - 1)
    drawn = order.gather(1, pick)[:, 0]
    return torch.where(is_greedy, greedy_tok, drawn).view(b, w)
