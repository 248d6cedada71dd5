"""The audio-token grammar, the repetition penalty and the checkpoint's generation defaults.

Grammar: at Orpheus audio position i only slot (i mod 7)'s 4,096 ids or end-of-speech are sampled,
greedy or not, whatever the logits. Penalty: transformers' rule, applied over the ids a stream
generated, kept on the device by the running batch, so the pipelined loop still equals the serial
loop and a pure reference. Both are functions of the stream alone (not of its batch companions).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.generation.grammar import Grammar, allowed, check_vocab, orpheus_audio_id
from tandem.backend.generation.orpheus_ids import END_OF_SPEECH as ORPHEUS_END_OF_SPEECH
from tandem.backend.generation.sampling import SamplingParams, mark_seen, processed_logits, sample
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.prompt import CONTRACT_DEFAULTS, REPETITION_PENALTY, GenerationDefaults, parse_params
from tandem.backend.settings import parse_settings
from tandem.backend.text.defaults import load_generation_defaults, resolve_grammar
from tandem.backend.text.frontend import Family, TextFrontend
from tandem.backend.text.tokenizer import TextTokenizer
from tests.support.engines import Job, decode_batch
from tests.support.text_models import llama3_tokenizer, orpheus_checkpoint, orpheus_config

V = 156940
ORPHEUS = orpheus_config()


def _slot_range(i: int) -> set[int]:
    lo = 128266 + (i % 7) * 4096
    return set(range(lo, lo + 4096))


def test_allowed_ids_are_the_slot_and_end_of_speech() -> None:
    mask = allowed(Grammar.ORPHEUS, torch.arange(15), V)
    assert mask.shape == (15, V)
    for i in range(15):
        ids = set(torch.nonzero(mask[i])[:, 0].tolist())
        assert ids == _slot_range(i) | {ORPHEUS_END_OF_SPEECH}
    assert allowed(Grammar.NONE, torch.arange(3), 10).all()
    assert orpheus_audio_id(8, 5) == 128266 + 4096 + 5
    with pytest.raises(ValueError, match="156938"):
        check_vocab(Grammar.ORPHEUS, 128266)
    with pytest.raises(ValueError, match="SNAC code 4096"):
        orpheus_audio_id(0, 4096)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 3.0])
def test_every_sample_obeys_the_grammar(temperature: float) -> None:
    """Logits that favour text ids and wrong slots: still only the slot's ids or end-of-speech."""
    g = torch.Generator().manual_seed(1)
    b, start = 21, 40
    logits = torch.randn((b, 1, V), generator=g) * 4
    logits[:, :, :128000] += 10.0  # text ids most likely
    logits[:, :, 128266 + 6 * 4096 :] += 5.0  # and the last slot
    params = [
        SamplingParams(temperature=temperature, seed=s, grammar=Grammar.ORPHEUS, grammar_start=start)
        for s in range(b)
    ]
    positions = [start + i for i in range(b)]
    toks = sample(logits, params, positions)[:, 0].tolist()
    for i, t in enumerate(toks):
        assert t in _slot_range(i) or t == ORPHEUS_END_OF_SPEECH, (i, t)
    # a row without the grammar in the same batch is untouched (it takes a text id)
    mixed = [*params[:2], SamplingParams(temperature=0.0)]
    out = sample(logits[:3], mixed, positions[:3])[:, 0].tolist()
    assert out[:2] == toks[:2] and out[2] < 128000


def test_grammar_and_penalty_do_not_depend_on_batch_companions() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn((6, 1, V), generator=g) * 3
    seen = torch.zeros((6, 1, V), dtype=torch.bool)
    mark_seen(seen, torch.randint(128266, V, (6, 1), generator=g))
    params = [
        SamplingParams(
            temperature=0.8, top_p=0.9, seed=7 + i, repetition_penalty=1.3, grammar=Grammar.ORPHEUS
        )
        for i in range(6)
    ]
    positions = [3, 9, 10, 11, 30, 31]
    together = sample(logits, params, positions, seen)
    for i in range(6):
        alone = sample(logits[i : i + 1], params[i : i + 1], positions[i : i + 1], seen[i : i + 1])
        assert torch.equal(alone, together[i : i + 1])


def test_penalty_equals_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn((2, 1, 97), generator=g) * 2
    history = torch.randint(0, 97, (2, 12), generator=g)
    seen = torch.zeros((2, 1, 97), dtype=torch.bool)
    for t in range(history.shape[1]):
        mark_seen(seen, history[:, t : t + 1])
    for penalty in (1.1, 1.3, 0.8):
        ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(history, logits[:, 0].clone())
        ours = processed_logits(
            logits.reshape(2, 97), [SamplingParams(repetition_penalty=penalty)] * 2, [0, 0], seen, 1
        )
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    untouched = processed_logits(logits.reshape(2, 97), [SamplingParams()] * 2, [0, 0], seen, 1)
    assert torch.equal(untouched, logits.reshape(2, 97))


def _reference(dec: Decoder, job: Job, n: int) -> np.ndarray:
    """The stream's rows from full forwards, with the penalty over what it generated: no pool, no batch."""
    sp = job.stream.sampling
    seq = [row for row in job.prompt]
    out = [job.first]
    seen = torch.zeros((1, dec.cfg.row_width, dec.cfg.vocab_size), dtype=torch.bool)
    mark_seen(seen, torch.from_numpy(job.first)[None])
    while len(out) < n:
        logits = dec.forward(torch.from_numpy(np.stack([*seq, *out])))[-1]
        row = sample(logits[None], [sp], [len(seq) + len(out)], seen)
        mark_seen(seen, row)
        out.append(row[0].numpy())
    return np.stack(out)


class PenaltyJob(Job):
    def __init__(self, dec: Decoder, pool, i: int, n: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(dec, pool, i, n)
        x = np.random.default_rng(i).integers(0, dec.cfg.vocab_size, size=(7 + 5 * i, dec.cfg.row_width))
        self.prompt = x
        self.stream.sampling = SamplingParams(
            temperature=0.7 * (i % 2), seed=i, repetition_penalty=(1.0, 1.5, 2.0)[i % 3], top_p=0.95
        )


@pytest.mark.parametrize("pipelined", [False, True])
def test_penalty_through_the_batch_equals_a_pure_reference(pipelined: bool) -> None:
    dec = Decoder.random(preset("tiny"), "cpu", seed=0)
    batch, pool = decode_batch(dec)
    jobs = [PenaltyJob(dec, pool, i, 10) for i in range(4)]
    for j in jobs[:2]:
        j.add_to(batch)
    turns = 0
    while len(batch) or turns <= 2:
        if turns == 2:
            for j in jobs[2:]:
                j.add_to(batch)
        batch.advance() if pipelined else batch.step()
        turns += 1
    batch.drain()
    for j in jobs:
        assert j.sink.error is None
        np.testing.assert_array_equal(j.sink.rows(), _reference(dec, j, 10))
    # the penalty really changed greedy stream 1's tokens
    plain = _reference_without_penalty(dec, jobs[1])
    assert not np.array_equal(plain, jobs[1].sink.rows())


def _reference_without_penalty(dec: Decoder, job: Job) -> np.ndarray:
    saved = job.stream.sampling
    job.stream.sampling = SamplingParams(temperature=saved.temperature, seed=saved.seed, top_p=saved.top_p)
    try:
        return _reference(dec, job, 10)
    finally:
        job.stream.sampling = saved


def test_orpheus_stream_through_the_batch_obeys_the_grammar() -> None:
    dec = Decoder.random(ORPHEUS, "cpu", seed=4)
    batch, pool = decode_batch(dec)
    job = Job(dec, pool, 0, 30)
    job.stream.sampling = SamplingParams(
        temperature=1.0, seed=3, grammar=Grammar.ORPHEUS, grammar_start=job.stream.prompt_len,
        repetition_penalty=1.2, stop_token_ids=(ORPHEUS_END_OF_SPEECH,),
    )  # fmt: skip
    # row 0 as P samples it, under the grammar at audio position 0 (the prompt Job prefilled)
    x = np.random.default_rng(0).integers(0, V, size=(7, 1))
    logits = dec.prefill(torch.from_numpy(x), pool, job.stream.slots[:7], 0)
    job.first = sample(logits[None], [job.stream.sampling], [job.stream.prompt_len])[0].numpy()
    job.add_to(batch)
    while len(batch):
        batch.step()
    rows = job.sink.rows()[:, 0].tolist()
    assert 1 <= len(rows) <= 30
    for i, t in enumerate(rows):
        assert t in _slot_range(i) or (t == ORPHEUS_END_OF_SPEECH and i == len(rows) - 1), (i, t)


# --- generation defaults -------------------------------------------------------------------------


def test_generation_config_gives_the_defaults(tmp_path: Path) -> None:
    ckpt = orpheus_checkpoint(tmp_path / "ckpt")
    settings = parse_settings({"model.checkpoint": str(ckpt)})
    tok = TextTokenizer.load(ckpt / "tokenizer.json")
    fe = TextFrontend(tok, Family.ORPHEUS, ORPHEUS, settings.limits)
    d = load_generation_defaults(settings, ORPHEUS, fe)
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == pytest.approx((0.6, 0.8, 0, 1.1))
    assert d.grammar == Grammar.ORPHEUS
    assert d.stop_token_ids == (128009, 128258)  # config.json's eos, generation_config's, end-of-speech
    params = parse_params({}, ORPHEUS, settings.limits, d)
    assert params.temperature == pytest.approx(0.6) and params.repetition_penalty == pytest.approx(1.1)
    assert params.grammar == Grammar.ORPHEUS and params.stop_token_ids == d.stop_token_ids
    given = parse_params({REPETITION_PENALTY: np.array([1.3], dtype=np.float32)}, ORPHEUS, settings.limits, d)
    assert given.repetition_penalty == pytest.approx(1.3)
    off = parse_settings({"model.checkpoint": str(ckpt), "frontend.grammar": "off"})
    assert load_generation_defaults(off, ORPHEUS, fe).grammar == Grammar.NONE
    # no checkpoint: the contract's defaults, no grammar
    assert load_generation_defaults(parse_settings({}), preset("tiny"), None) == GenerationDefaults(
        stop_token_ids=()
    )
    assert GenerationDefaults() == CONTRACT_DEFAULTS


def test_bad_generation_settings_are_load_errors(tmp_path: Path) -> None:
    ckpt = orpheus_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"unknown tandem\.frontend\.grammar 'on'"):
        resolve_grammar(parse_settings({"frontend.grammar": "on"}), None)
    with pytest.raises(ValueError, match="156938"):
        load_generation_defaults(parse_settings({"frontend.grammar": "orpheus"}), preset("tiny"), None)
    gen = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"top_p = 1\.5 is out of range"):
        load_generation_defaults(parse_settings({"model.checkpoint": str(ckpt)}), ORPHEUS, None)
    (ckpt / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id must be an id"):
        load_generation_defaults(parse_settings({"model.checkpoint": str(ckpt)}), ORPHEUS, None)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (np.array([0.0], dtype=np.float32), r"REPETITION_PENALTY = 0.0 is outside \(0, 10\]"),
        (np.array([11.0], dtype=np.float32), r"REPETITION_PENALTY = 11.0 is outside \(0, 10\]"),
        (np.array([np.nan], dtype=np.float32), "REPETITION_PENALTY = nan is not a finite number"),
        (np.array([1.1], dtype=np.float64), "REPETITION_PENALTY must be FP32, got FP64"),
        (np.array([1.1, 1.2], dtype=np.float32), r"REPETITION_PENALTY must have shape \[1\]"),
    ],
)
def test_bad_repetition_penalty(value: np.ndarray, needle: str) -> None:
    from tandem.backend.errors import InvalidInput
    from tandem.backend.settings import Limits

    with pytest.raises(InvalidInput, match=needle):
        parse_params({REPETITION_PENALTY: value}, preset("tiny"), Limits())


def test_llama3_tokenizer_fixture_layout() -> None:
    tok = llama3_tokenizer()
    assert tok.get_vocab_size() == V
    assert tok.token_to_id("<|eot_id|>") == 128009 and tok.token_to_id("<custom_token_0>") == 128256
    assert tok.token_to_id(f"<custom_token_{V - 128257}>") == V - 1
