"""What a gRPC client of `tts`/`tts_mono` can read of each error, through the real server: the code by
`serving.client_errors.classify` for tandem's errors (behind Triton's ensemble prefix) and Triton
core's own (no code in the message), as `tandem.gateway.client` reports them; and where TIMINGS is."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tandem.gateway.client import TTSClient, build_inputs, next_stream_id
from tandem.gateway.errors import ClientCode, classify
from tests.support.helpers import TINY_V, TINY_W, prompt


def _raw_stream(url: str, model: str, inputs: list, **kw) -> list[tuple[object, object]]:
    """Every (result, error) of one request on a plain tritonclient stream (no helper in between)."""
    got: queue.Queue[tuple[object, object]] = queue.Queue()
    out = []
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result=None, error=None: got.put((result, error)))
    try:
        c.async_stream_infer(model, inputs, enable_empty_final_response=True, **kw)
        while True:
            result, error = got.get(timeout=60)
            out.append((result, error))
            if error is not None:
                return out
            params = result.get_response().parameters  # type: ignore[attr-defined]
            if params["triton_final_response"].bool_param:
                return out
    finally:
        c.stop_stream()
        c.close()


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_tandem_and_triton_core_errors_get_a_code(server, model):
    with TTSClient(server.url, model) as c:
        vocab = c.run(np.full((5, TINY_W), TINY_V, np.int64), MAX_TOKENS=4)
    assert vocab.error_code is ClientCode.INVALID_ARG
    assert (
        vocab.error is not None
        and vocab.error.startswith("[INVALID_ARG] ")
        and "in ensemble" not in vocab.error
    )
    with TTSClient(server.url, model) as c:
        dtype = c.run(np.zeros((5, TINY_W), np.float32), MAX_TOKENS=4)  # refused by Triton core
    assert dtype.error_code is ClientCode.INVALID_ARG, dtype.error
    assert dtype.error is not None and "data-type is 'FP32'" in dtype.error


def test_same_tandem_error_reads_the_same_from_tts_and_tts_mono(server):
    errors = []
    for model in ("tts", "tts_mono"):
        with TTSClient(server.url, model) as c:
            errors.append(c.run(prompt(5), MAX_TOKENS=0).error)
    assert (
        errors[0] == errors[1] and errors[0] is not None and errors[0].startswith("[INVALID_ARG] MAX_TOKENS")
    )


def test_no_correlation_id_and_unknown_inputs_are_invalid_arg(server):
    (_, error), *_ = _raw_stream(server.url, "tts", build_inputs(prompt(5), MAX_TOKENS=4))  # no sequence_id
    assert error is not None
    err = classify(error.message(), error.status())  # type: ignore[attr-defined]
    # P refuses it itself (serving/triton_io.read_request: no pages offered for a stream D would
    # refuse); Triton's own "correlation ID" check would say the same where P did not run first.
    assert err.code is ClientCode.INVALID_ARG, err
    assert "no stream id" in err.detail or "correlation ID" in err.detail, err
    extra = grpcclient.InferInput("NOT_AN_INPUT", [1], "INT32")
    extra.set_data_from_numpy(np.array([1], np.int32))
    inputs = [*build_inputs(prompt(5)), extra]
    (_, error), *_ = _raw_stream(server.url, "tts_mono", inputs, sequence_id=next_stream_id())
    err = classify(error.message(), error.status())  # type: ignore[attr-defined]
    assert err.code is ClientCode.INVALID_ARG and "NOT_AN_INPUT" in err.detail, err


def test_unknown_model_is_not_found(server):
    (_, error), *_ = _raw_stream(server.url, "tts-1", build_inputs(prompt(5)), sequence_id=next_stream_id())
    assert classify(error.message(), error.status()).code is ClientCode.NOT_FOUND  # type: ignore[attr-defined]


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_timings_where_documented(server, model):
    """README: TIMINGS is an output of every response; the last one carries the server's stamps, `tts`'s
    first sounding one those up to D's `first_chunk` and the vocoder's `first_audio`, every other one
    is empty."""
    responses = _raw_stream(
        server.url,
        model,
        build_inputs(prompt(20), MAX_TOKENS=40, TEMPERATURE=0.0),
        sequence_id=next_stream_id(),
        sequence_start=True,
        sequence_end=True,
    )
    assert all(e is None for _, e in responses), [e for _, e in responses]
    texts = [r.as_numpy("TIMINGS")[0].decode() for r, _ in responses]  # type: ignore[attr-defined]
    assert len(texts) >= 3
    last = json.loads(texts[-1])
    assert {"entry", "first_chunk", "last_chunk"} <= set(last)
    if model == "tts":
        first = json.loads(texts[0])
        assert {"entry", "d_entry", "first_chunk", "first_audio"} <= set(first) and "last_chunk" not in first
        assert texts[1:-1] == [""] * (len(texts) - 2)
    else:
        assert texts[:-1] == [""] * (len(texts) - 1)
