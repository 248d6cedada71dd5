"""Sampling over a row's legal ids equals the masked whole-vocabulary draw, token for token.

A row under the Orpheus grammar is sampled over its 4,097 legal ids (`grammar.legal_ids`) and a step
whose every stream has a grammar computes only the head's rows of the grammar's span. Neither may
change a token: the reference is `sample_whole_vocabulary` (each grammar a mask over all 156,940 ids,
every pass over the whole row) on the logits of the whole head, compared here over seeds, positions,
penalties, top-k/top-p, temperatures, batches mixing slots and grammar-less rows, and end of speech;
then through P's forward and D's running batch against a pool-free reference loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.backend.generation import grammar as grammars
from tandem.backend.generation.grammar import Grammar, allowed, legal_ids
from tandem.backend.generation.orpheus_ids import END_OF_SPEECH as ORPHEUS_END_OF_SPEECH
from tandem.backend.generation.sampling import (
    SamplingParams,
    mark_seen,
    sample,
    sample_whole_vocabulary,
    step_span,
)
from tandem.backend.generation.vocab_span import VocabSpan
from tandem.backend.model.decoder import Decoder
from tests.support.engines import Job, ListSink, decode_batch
from tests.support.text_models import orpheus_config

V = 156940
SPAN = VocabSpan(ORPHEUS_END_OF_SPEECH, 128266 + 7 * 4096, V)


def test_legal_ids_are_the_allowed_ids_in_ascending_order() -> None:
    audio = torch.tensor([0, 1, 6, 7, 13, 700, 3])
    ids = legal_ids(Grammar.ORPHEUS, audio)
    mask = allowed(Grammar.ORPHEUS, audio, V)
    assert ids.shape == (7, 4097) and ids.dtype == torch.long
    for i in range(7):
        assert torch.equal(ids[i], torch.nonzero(mask[i])[:, 0])
    assert grammars.span(Grammar.ORPHEUS, V) == SPAN and SPAN.width == 28680
    assert grammars.legal_width(Grammar.ORPHEUS) == 4097
    with pytest.raises(ValueError, match="does not restrict"):
        legal_ids(Grammar.NONE, audio)


def test_step_span_is_the_grammars_span_unless_a_row_has_none() -> None:
    orpheus = SamplingParams(grammar=Grammar.ORPHEUS)
    assert step_span([orpheus, orpheus], V) == SPAN
    assert step_span([orpheus, SamplingParams()], V) == VocabSpan.whole(V)
    assert step_span([], V).is_whole
    with pytest.raises(ValueError, match="156938"):
        step_span([orpheus], 1000)
    with pytest.raises(ValueError, match="lo < hi"):
        VocabSpan(5, 5, 10)


def _params(rng: np.random.Generator, n: int, grammar_share: float) -> list[SamplingParams]:
    out = []
    for _ in range(n):
        out.append(
            SamplingParams(
                temperature=float(rng.choice([0.0, 0.3, 0.6, 1.0, 1.7])),
                top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3, 1e-6])),
                top_k=int(rng.choice([0, 0, 1, 40, 4096, 4097, 9000])),
                seed=int(rng.integers(0, 2**62)),
                repetition_penalty=float(rng.choice([1.0, 1.1, 1.5, 0.8])),
                grammar=Grammar.ORPHEUS if rng.random() < grammar_share else Grammar.NONE,
                grammar_start=int(rng.integers(0, 50)),
            )
        )
    return out


def _case(seed: int, b: int, w: int, grammar_share: float) -> tuple[torch.Tensor, list, list, torch.Tensor]:
    """Logits (audio ids and end-of-speech boosted on some rows, so it is drawn), params, positions and
    a penalty history that hits audio ids, end-of-speech and text ids."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn((b, w, V), generator=g) * float(rng.choice([1.0, 3.0]))
    logits[:, :, 128266:] += 2.0
    logits[: b // 4, :, ORPHEUS_END_OF_SPEECH] += 30.0  # a quarter of the rows favour end-of-speech
    params = _params(rng, b, grammar_share)
    positions = [p.grammar_start + int(rng.integers(0, 400)) for p in params]
    seen = torch.zeros((b, w, V), dtype=torch.bool)
    for _ in range(30):
        mark_seen(seen, torch.randint(128200, V, (b, w), generator=g))
    mark_seen(seen, torch.full((b, w), ORPHEUS_END_OF_SPEECH))
    return logits, params, positions, seen


@pytest.mark.parametrize(("seed", "grammar_share"), [(0, 1.0), (1, 1.0), (2, 0.7), (3, 0.5), (4, 0.0)])
def test_legal_ids_draw_equals_the_whole_vocabulary_draw(seed: int, grammar_share: float) -> None:
    logits, params, positions, seen = _case(seed, 48, 1, grammar_share)
    for history in (None, seen):
        want = sample_whole_vocabulary(logits, params, positions, history)
        got = sample(logits, params, positions, history)
        assert torch.equal(got, want)
        if all(p.grammar == Grammar.ORPHEUS for p in params):  # the step computed the span's rows only
            span = step_span(params, V)
            narrow = logits[:, :, span.lo : span.hi].contiguous()
            assert torch.equal(sample(narrow, params, positions, history, span), want)
    if grammar_share > 0:
        assert (want == ORPHEUS_END_OF_SPEECH).any()  # end of speech was among the draws compared
        assert ((want >= 128266) & (want != ORPHEUS_END_OF_SPEECH)).any()


def test_rows_of_several_columns_and_reordered_batches() -> None:
    logits, params, positions, seen = _case(5, 12, 3, 0.6)
    want = sample_whole_vocabulary(logits, params, positions, seen)
    assert torch.equal(sample(logits, params, positions, seen), want)
    order = [11, 3, 7, 0, 1, 10, 2, 9, 4, 8, 5, 6]
    shuffled = sample(logits[order], [params[i] for i in order], [positions[i] for i in order], seen[order])
    assert torch.equal(shuffled, want[order])


def test_a_span_that_does_not_hold_a_rows_ids_is_refused() -> None:
    logits = torch.randn((2, 1, SPAN.width))
    none = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="grammar NONE may emit"):
        sample(logits, [none, SamplingParams(grammar=Grammar.ORPHEUS)], [0, 0], span=SPAN)
    with pytest.raises(ValueError, match="do not match"):
        sample(logits, [none, none], [0, 0], span=VocabSpan(0, 10, 10))
    with pytest.raises(ValueError, match="seen must be"):
        sample(
            logits,
            [SamplingParams(grammar=Grammar.ORPHEUS)] * 2,
            [0, 0],
            torch.zeros(2, 1, 9, dtype=torch.bool),
            SPAN,
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_span_head_equals_the_whole_head_sliced(dtype: str) -> None:
    dec = Decoder.random(orpheus_config(dtype=dtype), "cpu", seed=2)
    h = torch.randn((9, dec.cfg.hidden_size), generator=torch.Generator().manual_seed(0)).to(
        dec.cfg.torch_dtype
    )
    whole = dec.head_logits(h)
    assert torch.equal(dec.head_logits(h, SPAN), whole[:, :, SPAN.lo : SPAN.hi])
    with pytest.raises(ValueError, match="vocabulary"):
        dec.head_logits(h, VocabSpan(0, 10, 10))


def _reference(dec: Decoder, job: Job, n: int) -> np.ndarray:
    """The stream's rows from pool-free forwards over the whole head, each drawn over the whole
    vocabulary with the grammar as a mask and the penalty over what it generated."""
    sp = job.stream.sampling
    seq = list(job.prompt)
    out: list[np.ndarray] = []
    seen = torch.zeros((1, 1, V), dtype=torch.bool)
    while len(out) < n:
        logits = dec.forward(torch.from_numpy(np.stack([*seq, *out])))[-1]
        row = sample_whole_vocabulary(logits[None], [sp], [len(seq) + len(out)], seen)
        mark_seen(seen, row)
        out.append(row[0].numpy())
        if int(row[0, 0]) in sp.stop_token_ids:
            break
    return np.stack(out)


class GrammarJob(Job):
    """A stream under the Orpheus grammar whose row 0 is P's: sampled from the prefill's logits of
    the span its parameters need (`step_span`), as `PrefillRun.forward` does."""

    def __init__(self, dec: Decoder, pool, i: int, n: int, params: SamplingParams) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dec, pool, i, n)
        self.prompt = np.random.default_rng(i).integers(0, V, size=(7 + 5 * i, 1))
        self.stream.sampling = params
        span = step_span([params], V)
        logits = dec.prefill(
            torch.from_numpy(self.prompt), pool, self.stream.slots[: len(self.prompt)], 0, span
        )
        self.first = sample(logits[None], [params], [len(self.prompt)], span=span)[0].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("with_plain_stream", [False, True])
def test_streams_through_p_and_the_batch_equal_the_whole_vocabulary_reference(
    with_plain_stream: bool,
) -> None:
    """All streams under the grammar: each step computes the head's span only; one stream without a
    grammar in the batch: the whole head, the grammar rows gathered from it. Tokens equal the
    reference either way, end of speech included."""
    dec = Decoder.random(orpheus_config(), "cpu", seed=4)
    batch, pool = decode_batch(dec)
    n = 14  # rows a stream; the reference recomputes its whole sequence for each
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, top_p=0.9, repetition_penalty=1.3),
        dict(temperature=0.7, top_k=50, repetition_penalty=1.1),
        dict(temperature=1.3, top_k=0, top_p=1.0),
    ]
    jobs = []
    for i, kind in enumerate(kinds):
        jobs.append(GrammarJob(dec, pool, i, n, SamplingParams(
            seed=100 + i, grammar=Grammar.ORPHEUS, grammar_start=7 + 5 * i,
            stop_token_ids=(ORPHEUS_END_OF_SPEECH,), **kind,  # type: ignore[arg-type]
        )))  # fmt: skip
    if with_plain_stream:
        plain = Job(dec, pool, 5, n)
        plain.prompt = np.random.default_rng(5).integers(0, V, size=(7 + 5 * 5, 1))
        plain.stream.sampling = SamplingParams(temperature=0.9, seed=5)  # Job's row 0 was drawn so
        jobs.append(plain)
    for j in jobs:
        j.add_to(batch)
    while len(batch):
        batch.advance()
    batch.drain()
    for j in jobs:
        assert j.sink.error is None
        np.testing.assert_array_equal(j.sink.rows(), _reference(dec, j, n))


def test_calibration_streams_sample_under_the_grammar_they_are_given() -> None:
    """D times its start-up steps with streams under its own grammar (the steps it will run)."""
    from tandem.backend.engines.decode import calibration

    dec = Decoder.random(orpheus_config(), "cpu", seed=5)
    batch, pool = decode_batch(dec)
    free = pool.num_free_pages
    sink = ListSink()
    calibration.add_stream(batch, 1, 3, 16, 12, sink, np.random.default_rng(0), Grammar.ORPHEUS)
    assert step_span([batch.streams[0].sampling], V) == SPAN
    while len(batch):
        batch.step()
    rows = sink.rows()[1:, 0].tolist()  # row 0 stands for P's: random
    assert len(rows) == 11
    for i, t in enumerate(rows, start=1):
        assert t in legal_ids(Grammar.ORPHEUS, torch.tensor([i]))[0].tolist(), (i, t)
    assert pool.num_free_pages == free
