"""Batched, order-independent token sampling.

No running RNG state: each uniform is a hash (splitmix64) of (seed, position, column), so a seeded
stream gets the same tokens whichever engine samples it (P its first row, D the rest) and whatever
shares its batch. Top-k, top-p, temperature and the inverse-CDF draw are vectorised on the logits'
device.

Before the draw: the repetition penalty (HF's and vLLM's rule, over a per-stream `seen` mask on the
device, `mark_seen`) and the stream's audio-token grammar (`grammar.py`), both pure functions of the
stream alone.

A row under a grammar is sampled over its legal ids only (`grammar.legal_ids`: Orpheus' 4,097), not
over the vocabulary with the rest masked: its logits are gathered at those ids (ascending), then the
penalty, the sort, top-k/top-p and the draw run over 4,097 columns, and the drawn column maps back to
its id. Masked ids sort last and carry zero probability, and the stable sort keeps the legal ids'
order, so the tokens equal the masked full-vocabulary draw (`sample_whole_vocabulary`, the reference
the tests hold this to). The logits may cover only a `VocabSpan` of the vocabulary (`step_span`: the
head's rows a step of grammar-bound streams needs); rows without a grammar need all of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tandem.backend.device import upload
from tandem.backend.generation import grammar as grammars
from tandem.backend.generation.grammar import Grammar, allowed
from tandem.backend.generation.vocab_span import VocabSpan

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


def step_span(params: Sequence[SamplingParams], vocab_size: int) -> VocabSpan:
    """The ids one step must compute logits for: the union of the rows' grammars' spans, or the
    whole vocabulary when a row has no grammar (or there are no rows). Raises ValueError when a
    grammar's ids do not fit the vocabulary. Called by the engines before the output head runs."""
    kinds = {p.grammar for p in params}
    if not kinds or Grammar.NONE in kinds:
        return VocabSpan.whole(vocab_size)
    spans = [grammars.span(g, vocab_size) for g in sorted(kinds)]
    out = spans[0]
    for other in spans[1:]:
        out = out.union(other)
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None = None,
    span: VocabSpan | None = None,
) -> torch.Tensor:
    """`sample_on_device(...)` brought to the CPU (waits for the device): LongTensor [B, W] on CPU."""
    return sample_on_device(logits, params, positions, seen, span).cpu()


def mark_seen(seen: torch.Tensor, rows: torch.Tensor) -> None:
    """Record sampled `rows` LongTensor [B, W] in `seen` Bool [B, W, V] (written), on their device;
    nothing waits for it. Called by the running batch after every step, for the next step's penalty."""
    seen.scatter_(2, rows.to(seen.device)[:, :, None], True)


def _per_row(values: list[Any], dtype: torch.dtype, w: int, dev: torch.device) -> torch.Tensor:
    """One value per stream -> [N*w, 1] on `dev` (each stream's value for each of its W columns)."""
    return upload(torch.tensor(values, dtype=dtype).repeat_interleave(w), dev)[:, None]


def _penalised(
    flat: torch.Tensor, params: Sequence[SamplingParams], hit: torch.Tensor | None, w: int
) -> torch.Tensor:
    """`flat` float32 [N*w, C] after the repetition penalty at the columns `hit` (Bool, same shape:
    ids the row's stream generated) marks; `flat` itself when no row has a penalty (never written)."""
    if hit is None or not any(p.penalised for p in params):
        return flat
    pen = _per_row([p.repetition_penalty for p in params], torch.float32, w, flat.device)
    return torch.where(hit, torch.where(flat > 0, flat / pen, flat * pen), flat)


def processed_logits(
    flat: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None,
    w: int,
) -> torch.Tensor:
    """The float32 logits [B*W, V] after the repetition penalty and the grammar as a mask over the
    whole vocabulary (a new tensor when either applies; `flat` is never written). The reference
    path's (`sample_whole_vocabulary`) and the penalty's tests'."""
    dev, v = flat.device, flat.shape[1]
    flat = _penalised(flat, params, None if seen is None else seen.reshape(flat.shape), w)
    for grammar in sorted({p.grammar for p in params} - {Grammar.NONE}):
        audio = [pos - p.grammar_start for p, pos in zip(params, positions, strict=True)]
        member = [p.grammar == grammar for p in params]
        audio_dev = upload(torch.tensor(audio, dtype=torch.long).repeat_interleave(w), dev)
        member_dev = upload(torch.tensor(member, dtype=torch.bool).repeat_interleave(w), dev)
        ok = allowed(grammar, audio_dev, v) | ~member_dev[:, None]
        flat = flat.masked_fill(~ok, float("-inf"))
    return flat


def _draw(
    flat: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], w: int
) -> torch.Tensor:
    """The drawn column of each row of float32 `flat` [N*w, C] (penalty and grammar applied; stream
    n's W columns are rows n*w .. n*w+w-1) -> int64 [N*w] on its device; nothing waits for it.

    Greedy rows take the argmax; the others top-k, top-p (the smallest most-likely set of mass >=
    top_p), temperature and an inverse-CDF draw with the uniform of (seed, position, W-column). Ties
    go to the lower column everywhere, so top_k=1 or a tiny top_p equals greedy. Columns of -inf
    (masked ids) sort last and get zero probability, which is why the draw over a row's legal ids
    alone gives the tokens of the masked whole-vocabulary row."""
    dev, v = flat.device, flat.shape[1]
    greedy_tok = flat.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_tok
    temp = _per_row([p.temperature if not p.greedy else 1.0 for p in params], torch.float32, w, dev)
    top_p = _per_row([p.top_p for p in params], torch.float32, w, dev)
    top_k = _per_row([float(p.top_k if p.top_k > 0 else v) for p in params], torch.float32, w, dev)
    is_greedy = _per_row([float(p.greedy) for p in params], torch.float32, w, dev)[:, 0] > 0
    u = upload(
        uniforms([p.seed for p in params], positions, w).reshape(len(params) * w, 1), dev, torch.float32
    )

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
    return torch.where(is_greedy, greedy_tok, drawn)


def _check(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> None:
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, W, V], got {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(positions) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows need {logits.shape[0]} params and positions")


def sample_whole_vocabulary(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference: `sample_on_device` over float32 logits [B, W, V] of the whole vocabulary with
    each grammar as a mask (every pass spans V columns) -> LongTensor [B, W] on their device. What
    every row was sampled with before rows under a grammar were sampled over their legal ids; the
    tests and `python -m tandem.bench.sampler` hold `sample_on_device` to it."""
    _check(logits, params, positions)
    b, w, v = logits.shape
    if b == 0:
        return torch.empty((0, w), dtype=torch.long, device=logits.device)
    flat = processed_logits(logits.float().reshape(b * w, v), params, positions, seen, w)
    return _draw(flat, params, positions, w).view(b, w)


def _sample_rows(
    flat: torch.Tensor,
    grammar: Grammar,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None,
    span: VocabSpan,
    w: int,
) -> torch.Tensor:
    """Tokens [N*w] of streams that share `grammar`: flat float32 [N*w, span.width], seen Bool
    [N*w, V] or None. Under a grammar, the rows' legal ids are gathered first (columns ascending by
    id), so every pass after spans `grammars.legal_width(grammar)` columns."""
    if grammar == Grammar.NONE:
        return _draw(_penalised(flat, params, seen, w), params, positions, w)
    audio = [pos - p.grammar_start for p, pos in zip(params, positions, strict=True)]
    audio_dev = upload(torch.tensor(audio, dtype=torch.long).repeat_interleave(w), flat.device)
    ids = grammars.legal_ids(grammar, audio_dev)  # [N*w, K], global ids
    values = flat.gather(1, ids - span.lo if span.lo else ids)
    penalised = any(p.penalised for p in params)
    hit = seen.gather(1, ids) if seen is not None and penalised else None
    col = _draw(_penalised(values, params, hit, w), params, positions, w)
    return ids.gather(1, col[:, None])[:, 0]


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    seen: torch.Tensor | None = None,
    span: VocabSpan | None = None,
) -> torch.Tensor:
    """Draw a token per (row, column) from float32 logits [B, W, n] -> LongTensor [B, W] of global ids
    on their device (the caller's); nothing waits for the device.

    Logits column c is id span.lo + c (span None: the whole vocabulary, n = V); `span` must cover every
    row's grammar (`step_span` does) and be the whole vocabulary when a row has none. `seen` Bool
    [B, W, V] holds row b's stream's generated ids for the repetition penalty (None: no penalty).
    Row b samples at position positions[b] (its uniform's) and audio position positions[b] -
    params[b].grammar_start (its grammar's). Rows are sampled in groups of one grammar; a row under a
    grammar over its legal ids only (module docstring), with the tokens of `sample_whole_vocabulary`."""
    _check(logits, params, positions)
    b, w, n = logits.shape
    dev = logits.device
    span = VocabSpan.whole(n) if span is None else span
    if span.width != n:
        raise ValueError(f"logits of {n} columns do not match {span}")
    if seen is not None and seen.shape != (b, w, span.vocab_size):
        raise ValueError(f"seen must be [{b}, {w}, {span.vocab_size}], got {tuple(seen.shape)}")
    if b == 0:
        return torch.empty((0, w), dtype=torch.long, device=dev)
    members: dict[Grammar, list[int]] = {}
    for i, p in enumerate(params):
        members.setdefault(p.grammar, []).append(i)
    for g in members:
        need = grammars.span(g, span.vocab_size)
        if not span.covers(need):
            raise ValueError(f"logits of {span} do not hold the ids grammar {g.name} may emit ({need})")
    flat = logits.float().reshape(b * w, n)
    seen_flat = None if seen is None else seen.reshape(b * w, span.vocab_size)
    if len(members) == 1:  # the usual step: one grammar (or none) for every stream, no regrouping
        ((g, _),) = members.items()
        return _sample_rows(flat, g, params, positions, seen_flat, span, w).view(b, w)
    out = torch.empty(b * w, dtype=torch.long, device=dev)
    for g, rows in sorted(members.items()):
        flat_rows = upload(torch.tensor([r * w + j for r in rows for j in range(w)], dtype=torch.long), dev)
        tokens = _sample_rows(
            flat.index_select(0, flat_rows),
            g,
            [params[r] for r in rows],
            [positions[r] for r in rows],
            None if seen_flat is None else seen_flat.index_select(0, flat_rows),
            span,
            w,
        )
        out.index_copy_(0, flat_rows, tokens)
    return out.view(b, w)
