"""Every error a client can receive gets its code: tandem's bracketed codes behind Triton's prefixes,
Triton core's code-less messages (as 2.51 words them, seen through the real server in
tests/integration/test_gateway.py and test_tts.py), and the gRPC status of a broken stream."""

from __future__ import annotations

import pytest

from tandem.gateway.errors import HTTP_STATUS, ClientCode, classify


@pytest.mark.parametrize(
    ("message", "status", "code", "detail"),
    [
        (
            "[INVALID_ARG] MAX_TOKENS = 0 is outside [1, 2048]",
            None,
            "INVALID_ARG",
            "MAX_TOKENS = 0 is outside [1, 2048]",
        ),
        ("in ensemble 'tts', [UNAVAILABLE] no capacity", None, "UNAVAILABLE", "no capacity"),
        (
            "[request id: 7] in ensemble 'tts', [INTERNAL] KV transfer 3 failed",
            None,
            "INTERNAL",
            "KV transfer 3 failed",
        ),
        (
            "in ensemble 'tts', [CANCELLED] client cancelled the stream",
            None,
            "CANCELLED",
            "client cancelled the stream",
        ),
        (
            "[request id: 48] inference input 'PROMPT' data-type is 'FP32', but model 'tts' expects 'INT64'",
            None,
            "INVALID_ARG",
            "inference input 'PROMPT' data-type is 'FP32', but model 'tts' expects 'INT64'",
        ),
        (
            "in ensemble 'tts', inference request to model 'decode' must specify a non-zero or non-empty "
            "correlation ID",
            None,
            "INVALID_ARG",
            None,
        ),
        (
            "unexpected shape for input 'PROMPT' for model 'tts'. Expected [-1,4], got [3]",
            None,
            "INVALID_ARG",
            None,
        ),
        (
            "[request id: r1] input byte size mismatch for input 'PROMPT' for model 'tts_mono'. "
            "Expected -96, got 96",
            None,
            "INVALID_ARG",
            None,
        ),
        (
            "All input dimensions should be specified for input 'PROMPT' for model 'tts', got [-1,4]",
            None,
            "INVALID_ARG",
            None,
        ),
        ("unexpected inference input 'FOO' for model 'tts'", None, "INVALID_ARG", None),
        ("expected 1 inputs but got 0 inputs for model 'tts'", None, "INVALID_ARG", None),
        ("Request for unknown model: 'tts-1' is not found", None, "NOT_FOUND", None),
        ("in ensemble 'tts', Stub process 'prefill_0_0' is not healthy.", None, "UNAVAILABLE", None),
        ("failed to connect to all addresses", "StatusCode.UNAVAILABLE", "UNAVAILABLE", None),
        ("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED", "UNAVAILABLE", None),
        ("Locally cancelled by application!", "StatusCode.CANCELLED", "CANCELLED", None),
        ("something nobody wrote down", None, "INTERNAL", "something nobody wrote down"),
    ],
)
def test_classify(message, status, code, detail):
    err = classify(message, status)
    assert err.code is ClientCode(code)
    if detail is not None:
        assert err.detail == detail
    assert str(err).startswith(f"[{code}] ")
    assert "in ensemble" not in err.detail and "[request id" not in err.detail


def test_a_bracketed_code_wins_over_the_message_patterns():
    assert classify("[UNAVAILABLE] model 'tts' is not found in the cache").code is ClientCode.UNAVAILABLE


def test_every_code_has_an_http_status():
    assert set(HTTP_STATUS) == set(ClientCode)
    assert HTTP_STATUS[ClientCode.INVALID_ARG] == 400 and HTTP_STATUS[ClientCode.UNAVAILABLE] == 503
