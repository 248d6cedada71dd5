"""Sesame CSM through the engines without Triton: the monolithic engine, and P + D in one process
(real transfer library, host path), make with CSM's row step (backend/model/row_step.py) exactly
the frames the reference loop (`csm_frames.generate`, held to transformers' generate in
test_csm_generation.py) makes, greedy and seeded; a stream whose frame is CSM's end frame ends
there."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from tandem.backend.engines.decode.engine import DecodeEngine, DecodeRequest
from tandem.backend.engines.mono import MonoEngine
from tandem.backend.engines.parts import csm_row_step
from tandem.backend.engines.prefill import PrefillEngine, PrefillRequest
from tandem.backend.engines.stream import EngineRequest
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import CsmModel, load_csm
from tandem.backend.model.csm_frames import generate
from tandem.backend.text.csm import Utterance, prompt_rows
from tandem.backend.timing import Timings
from tests.support.csm import CODEBOOKS, MIMI_CODES, TEXT_VOCAB, write_csm
from tests.support.engines import HandoffBox, ListSink, engine_settings

pytest.importorskip("transformers")
BOS, EOS = 1, 4  # the tiny config's text ids (tests/support/csm.py)
JOBS = [  # (text seed, context frames, sampling, frames)
    (1, 0, SamplingParams(), 5),
    (2, 4, SamplingParams(temperature=1.0, top_k=20, seed=7), 6),
    (3, 3, SamplingParams(temperature=0.8, top_p=0.9, seed=11), 4),
]


@pytest.fixture(scope="module")
def csm(tmp_path_factory: pytest.TempPathFactory) -> CsmModel:
    path = tmp_path_factory.mktemp("csm")
    write_csm(path, seed=3)
    return load_csm(path)


def _prompt(model: CsmModel, seed: int, context_frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    text = np.concatenate([[BOS], rng.integers(5, TEXT_VOCAB, size=4 + seed), [EOS]]).astype(np.int64)
    turns = [Utterance(text)]
    if context_frames:
        codes = rng.integers(0, 64, size=(context_frames, CODEBOOKS))
        turns.insert(0, Utterance(text[::-1].copy(), codes))
    return prompt_rows(turns, model.shape.rows, model.shape.codebook_eos)


def _reference(model: CsmModel, prompt: np.ndarray, params: SamplingParams, frames: int) -> np.ndarray:
    return generate(model, torch.from_numpy(prompt), frames, params, codes=model.shape.mimi_codes).numpy()


@pytest.fixture
def engines(csm: CsmModel, tmp_path, monkeypatch) -> Iterator[tuple[MonoEngine, PrefillEngine, DecodeEngine]]:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, max_batch=4, prefill_batch_max=2)
    s = replace(s, batch=replace(s.batch, cuda_graphs=False))
    step = csm_row_step(csm, s)
    mono = MonoEngine(csm.backbone, s, RecordingMetrics(), step)
    p = PrefillEngine(
        csm.backbone, s, RecordingMetrics(), "p0", lambda r: pytest.fail(r), csm_row_step(csm, s)
    )
    d = DecodeEngine(csm.backbone, s, RecordingMetrics(), csm_row_step(csm, s))
    for e in (mono, p, d):
        e.start()
    try:
        yield mono, p, d
    finally:
        d.close()
        p.close()
        mono.close()


def test_mono_and_pd_make_the_reference_frames(csm: CsmModel, engines) -> None:
    mono, p, d = engines
    jobs = [(_prompt(csm, seed, ctx), sp, n) for seed, ctx, sp, n in JOBS]
    mono_sinks, pd_sinks = [], []
    for i, (x, sp, n) in enumerate(jobs):  # all queued at once: they share forwards and steps
        mono_sinks.append(ListSink())
        mono.submit(EngineRequest(i + 1, x, sp, n, mono_sinks[-1], Timings()))
    for i, (x, sp, n) in enumerate(jobs):
        box = HandoffBox()
        p.submit(PrefillRequest(i + 1, x, sp, n, box, Timings()))
        assert box.done.wait(30) and box.error is None and box.handoff is not None
        pd_sinks.append(ListSink())
        d.submit(DecodeRequest(i + 1, box.handoff, pd_sinks[-1], Timings(box.handoff.timings)))
    for (x, sp, n), a, b in zip(jobs, mono_sinks, pd_sinks, strict=True):
        assert a.done.wait(60) and b.done.wait(60)
        assert a.error is None and b.error is None, (a.error, b.error)
        expected = _reference(csm, x, sp, n)
        got = a.rows()
        assert got.shape == (expected.shape[0], CODEBOOKS + 1)
        assert (got[:, CODEBOOKS] == ABSENT).all()  # generated rows carry no text
        np.testing.assert_array_equal(got[:, :CODEBOOKS], expected)
        np.testing.assert_array_equal(b.rows(), got)
    assert csm.shape.mimi_codes == MIMI_CODES


def test_served_frames_sample_only_mimis_codes(csm: CsmModel, engines) -> None:
    """CSM's vocabulary is Mimi's codes plus ids no Mimi decodes: a hot stream over many frames
    draws them when sampling the whole vocabulary (the reference without `codes`), never served."""
    mono, _, _ = engines
    x, hot, n = _prompt(csm, 6, 2), SamplingParams(temperature=3.0, seed=3), 24
    whole = generate(csm, torch.from_numpy(x), n, hot).numpy()
    assert (whole >= MIMI_CODES).any()
    sink = ListSink()
    mono.submit(EngineRequest(1, x, hot, n, sink, Timings()))
    assert sink.done.wait(60) and sink.error is None
    assert (sink.rows()[:, :CODEBOOKS] < MIMI_CODES).all()


def test_a_stream_ends_at_the_end_frame(tmp_path, monkeypatch) -> None:
    # Zero heads: every logit ties, so greedy draws id 0, CSM's codebook eos, in every codebook.
    path = tmp_path / "csm"
    write_csm(path, seed=4)
    model = load_csm(path)
    with torch.no_grad():
        model.backbone.lm_head.weight.zero_()
        model.depth.codebooks_head.zero_()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, max_batch=2)
    mono = MonoEngine(model.backbone, s, RecordingMetrics(), csm_row_step(model, s))
    p = PrefillEngine(
        model.backbone, s, RecordingMetrics(), "p0", lambda r: pytest.fail(r), csm_row_step(model, s)
    )
    mono.start()
    p.start()
    try:
        x = _prompt(model, 5, 2)
        sink, box = ListSink(), HandoffBox()
        mono.submit(EngineRequest(1, x, SamplingParams(), 8, sink, Timings()))
        p.submit(PrefillRequest(1, x, SamplingParams(), 8, box, Timings()))
        assert sink.done.wait(30) and sink.error is None
        np.testing.assert_array_equal(sink.rows(), [[0] * CODEBOOKS + [ABSENT]])
        assert box.done.wait(30) and box.error is None and box.handoff is not None
        assert box.handoff.ticket is None  # ended at row 0: nothing for D to pull
    finally:
        p.close()
        mono.close()
