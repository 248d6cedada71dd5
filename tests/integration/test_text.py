"""TEXT (+ VOICE) through the real tritonserver: the `frontend` step of `tts` and `tts_mono`'s own
front end give the rows the tokenizer and template make, so a text request streams exactly the
tokens of the equivalent PROMPT request; `tts` equals `tts_mono`; every bad text input is refused
with INVALID_ARG naming it and the server goes on serving.

Two repositories: the checked-in CPU default (tiny model, byte tokenizer, plain template) and one
rendered for a generated Orpheus-layout checkpoint (llama3 RoPE, tied embeddings, vocabulary
156,940, Llama-3-style tokenizer.json, Orpheus' voices listed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.model.config import preset
from tandem.backend.prompt import TextRequest
from tandem.backend.settings import Limits
from tandem.backend.text.frontend import Family, TextFrontend
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.serving.repository import tensor_dims
from tests.support.helpers import TINY_W, prompt, run
from tests.support.server import TritonProcess
from tests.support.text_models import CHECKED_IN_TOKENIZER, ORPHEUS_VOCAB, orpheus_checkpoint, orpheus_config

MODELS = ("tts", "tts_mono")
TEXT = "Hello, world: streaming speech from text."


def tiny_rows(text: str, voice: str = "") -> np.ndarray:
    fe = TextFrontend(TextTokenizer.load(CHECKED_IN_TOKENIZER), Family.PLAIN, preset("tiny"), Limits())
    return fe.rows(TextRequest(text, voice))


@pytest.mark.parametrize("model", MODELS)
def test_text_gives_the_tokens_of_its_prompt(server, model):
    rows = tiny_rows(TEXT, "tara")
    assert rows.shape[1] == TINY_W
    by_text = run(server.url, model, None, TEXT=TEXT, VOICE="tara", MAX_TOKENS=12, TEMPERATURE=0.0)
    by_prompt = run(server.url, model, rows, MAX_TOKENS=12, TEMPERATURE=0.0)
    assert by_text.error is None and by_prompt.error is None, (by_text.error, by_prompt.error)
    assert by_text.rows.shape == (12, TINY_W)
    np.testing.assert_array_equal(by_text.rows, by_prompt.rows)
    np.testing.assert_array_equal(by_text.audio, by_prompt.audio)


def test_tts_equals_tts_mono_with_text(server):
    for params in ({"TEMPERATURE": 0.0}, {"TEMPERATURE": 1.0, "SEED": 11, "TOP_P": 0.9}):
        a = run(server.url, "tts", None, TEXT=TEXT, MAX_TOKENS=10, **params)
        b = run(server.url, "tts_mono", None, TEXT=TEXT, MAX_TOKENS=10, **params)
        assert a.error is None and b.error is None, (a.error, b.error)
        np.testing.assert_array_equal(a.rows, b.rows)


BAD = [
    ({"TEXT": "hi", "prompt": True}, "exactly one of PROMPT and TEXT, not both"),
    ({}, "exactly one of PROMPT and TEXT; it has neither"),
    ({"VOICE": "ana"}, "VOICE needs TEXT"),
    ({"VOICE": "ana", "prompt": True}, "VOICE goes with TEXT only"),
    ({"TEXT": ""}, "TEXT is empty"),
    ({"TEXT": "  \n"}, "TEXT is blank"),
    ({"TEXT": b"ok \xff\xfe"}, "TEXT is not valid UTF-8 (byte 3)"),
    ({"TEXT": "x" * 4097}, "TEXT is 4097 bytes; the limit is 4096"),
    ({"TEXT": "hi", "VOICE": b"\xc3"}, "VOICE is not valid UTF-8"),
    ({"TEXT": "é" * 2100}, "TEXT is 4200 bytes; the limit is 4096"),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("case", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_text_refused(server, model, case, needle):
    params = dict(case)
    p = prompt(5) if params.pop("prompt", False) else None
    r = run(server.url, model, p, MAX_TOKENS=4, **params)
    assert r.error is not None and "[INVALID_ARG]" in r.error and needle in r.error, r.error
    ok = run(server.url, model, None, TEXT="still serving", MAX_TOKENS=2)
    assert ok.error is None and ok.rows.shape == (2, TINY_W), ok.error


def test_text_over_the_row_limit_is_refused(server):
    # 4096 bytes of text are fine for the byte limit but make 4097 rows with BOS: over max_prompt_rows
    assert Limits().max_prompt_rows == 4096
    for model in MODELS:
        r = run(server.url, model, None, TEXT="a" * 4096, MAX_TOKENS=2)
        assert r.error is not None and "TEXT makes 4097 prompt rows; the limit is 4096" in r.error, r.error


# --- an Orpheus-layout checkpoint --------------------------------------------------------------------


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonProcess, Path]]:
    ckpt = orpheus_checkpoint(tmp_path_factory.mktemp("orpheus") / "ckpt", voices=True)
    model = {"tandem.model.checkpoint": str(ckpt), "tandem.model.preset": ""}
    published = {"row_width": "1", "vocab_size": str(ORPHEUS_VOCAB)}
    overrides = {
        "frontend": {**model, "tandem.frontend.tokenizer": ""},
        "prefill": model,
        # a 156,940-id head on a shared 2-core CPU: no start-up calibration of D's rate-floor model
        # and no rate admission (both about GPU capacity, not what this module checks)
        "decode": {**model, "tandem.batch.calibrate_steps": "0", "tandem.batch.rate_admission": "false"},
        "tts_mono": {**model, **published, "tandem.frontend.tokenizer": ""},
        "tts": published,
    }
    dims = tensor_dims(1, 1)  # one id per row; the reference codec's frames are rows
    proc = TritonProcess(tmp_path_factory.mktemp("triton-orpheus"), overrides, dims=dims).start(timeout_s=600)
    yield proc, ckpt
    proc.stop()


def orpheus_rows(ckpt: Path, text: str, voice: str) -> np.ndarray:
    tok = TextTokenizer.load(ckpt / "tokenizer.json")
    ids = [128259, *tok.encode(f"{voice}: {text}" if voice else text), 128009, 128260, 128261, 128257]
    return np.asarray(ids, dtype=np.int64)[:, None]


def test_orpheus_text_and_voice_give_the_prompt_tokens(orpheus):
    proc, ckpt = orpheus
    rows = orpheus_rows(ckpt, TEXT, "tara")
    assert rows[1, 0] == 128000  # the tokenizer's BOS inside the template
    results = {}
    for model in MODELS:
        by_text = run(proc.url, model, None, TEXT=TEXT, VOICE="tara", MAX_TOKENS=14, TEMPERATURE=0.0)
        by_prompt = run(proc.url, model, rows, MAX_TOKENS=14, TEMPERATURE=0.0)
        assert by_text.error is None and by_prompt.error is None, (by_text.error, by_prompt.error)
        np.testing.assert_array_equal(by_text.rows, by_prompt.rows)
        results[model] = by_text.rows
    np.testing.assert_array_equal(results["tts"], results["tts_mono"])
    seeded = [
        run(proc.url, m, None, TEXT=TEXT, MAX_TOKENS=14, TEMPERATURE=0.8, TOP_P=0.9, SEED=3).rows
        for m in MODELS
    ]
    np.testing.assert_array_equal(*seeded)


def test_orpheus_unknown_voice_refused(orpheus):
    proc, _ = orpheus
    for model in MODELS:
        r = run(proc.url, model, None, TEXT="hi", VOICE="bob", MAX_TOKENS=2)
        assert (
            r.error is not None and "[INVALID_ARG] VOICE 'bob' is not one of this model's voices" in r.error
        )
        assert "tara" in r.error


def test_orpheus_checkpoint_shape():
    cfg = orpheus_config()
    assert cfg.vocab_size == 156940 and cfg.tie_word_embeddings and cfg.rope_scaling is not None


def _obeys_grammar(tokens: np.ndarray) -> bool:
    ids = tokens[:, 0].tolist()
    for i, t in enumerate(ids):
        lo = 128266 + (i % 7) * 4096
        if not (lo <= t < lo + 4096 or (t == 128258 and i == len(ids) - 1)):
            return False
    return True


def test_orpheus_samples_under_the_grammar_with_the_checkpoints_defaults(orpheus):
    """No sampling input: generation_config.json's temperature 0.6, top_p 0.8, repetition penalty 1.1;
    every token is an audio id of its slot (or the closing end-of-speech); tts equals tts_mono."""
    proc, _ = orpheus
    for extra in ({}, {"REPETITION_PENALTY": 1.3}, {"TEMPERATURE": 0.0}):
        got = [run(proc.url, m, None, TEXT=TEXT, VOICE="leo", MAX_TOKENS=21, SEED=5, **extra) for m in MODELS]
        for r in got:
            assert r.error is None, r.error
            assert _obeys_grammar(r.rows), r.rows[:, 0]
        np.testing.assert_array_equal(got[0].rows, got[1].rows)


@pytest.mark.parametrize("model", MODELS)
def test_bad_repetition_penalty_refused(server, model):
    bad = ((0.0, "REPETITION_PENALTY = 0.0 is outside (0, 10]"), (float("nan"), "not a finite"))
    for value, needle in bad:
        r = run(server.url, model, prompt(5), MAX_TOKENS=2, REPETITION_PENALTY=value)
        assert r.error is not None and "[INVALID_ARG]" in r.error and needle in r.error, r.error
    ok = run(server.url, model, prompt(5), MAX_TOKENS=3, REPETITION_PENALTY=1.2, SEED=1)
    assert ok.error is None and ok.rows.shape == (3, TINY_W)
