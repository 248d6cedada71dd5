"""Faults the PD handoff must turn into a clear error on that one stream, with others unaffected.

The internal `prefill` and `decode` models are driven directly (they are ordinary Triton models), so a
test can hold a real HANDOFF, replay it, forge one, or let it expire.
"""

from __future__ import annotations

import json
import time

import pytest

from tandem.gateway.client import run_concurrent
from tests.support.fault_hooks import fault_parameters
from tests.support.helpers import (
    TINY_W,
    decode,
    handoff,
    metric_value,
    metrics_text,
    prompt,
    wait_metric,
)
from tests.support.server import TritonProcess


def test_handoff_decodes_once_and_replay_is_refused(server):
    text = handoff(server.url)
    out, err = decode(server.url, text)
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8
    out, err = decode(server.url, text)  # the same transfer id again: P has finished with it
    assert err is not None and "[INTERNAL]" in err and "KV transfer" in err, err


def test_unknown_transfer_is_refused_promptly(server):
    forged = json.loads(handoff(server.url))
    forged["ticket"]["transfer_id"] = "0" * 32
    t0 = time.monotonic()
    _, err = decode(server.url, json.dumps(forged))
    assert err is not None and "KV transfer" in err and "0" * 32 in err, err
    assert time.monotonic() - t0 < 2.0  # P says "unknown" at once; no deadline wait


def test_malformed_handoff_is_invalid_arg(server):
    _, err = decode(server.url, '{"ticket": 5}')
    assert err is not None and "[INVALID_ARG]" in err and "malformed handoff" in err, err


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("first_row", [1, 2], "is not 4 ids"),  # wrong row width: would break every batched step
        ("first_row", [1, 2, 3, 10**6], "ids below"),  # an id past the vocabulary
        ("prompt_len", 7, "ticket carries"),  # disagrees with the ticket: the scatter would fault
        ("max_new_rows", -5, "must be positive"),
        ("max_new_rows", 10**7, "exceed D's whole pool"),
    ],
)
def test_tampered_handoff_fields_are_invalid_arg(server, field, value, says):
    """Each bad field of a real handoff is refused before D allocates anything; D keeps serving."""
    forged = json.loads(handoff(server.url))
    forged[field] = value
    _, err = decode(server.url, json.dumps(forged))
    assert err is not None and "[INVALID_ARG]" in err and "malformed handoff" in err and says in err, err
    out, err = decode(server.url, handoff(server.url))
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory):
    """A server whose P delays every 3rd copy past D's deadline and corrupts every 5th copy after its
    checksum, with short ticket TTLs: every PD fault of docs/failure-semantics.md, in one unit."""
    overrides = {
        "prefill": {
            **fault_parameters(delay_every=3, delay_s=1.5, corrupt_every=5),
            "tandem.transfer.ticket_ttl_s": "1.0",
            "tandem.transfer.max_held_acks": "1000",
        },
        # Admission is not under test here (see test_fault_matrix.OVERRIDES): admit every stream.
        "decode": {
            "tandem.batch.rate_admission": "false",
            "tandem.transfer.deadline_s": "0.5",
            "tandem.transfer.abort_retry_s": "0.1",
        },
    }
    proc = TritonProcess(tmp_path_factory.mktemp("faulty"), overrides).start()
    yield proc
    proc.stop()


def test_expired_ticket_is_refused(faulty):
    text = handoff(faulty.url)
    time.sleep(1.5)  # past the ticket TTL: P released the source
    _, err = decode(faulty.url, text)
    assert err is not None and "KV transfer" in err, err


def test_delays_and_corruption_fail_only_their_streams(faulty):
    jobs = [(prompt(20 + i, seed=i), {"MAX_TOKENS": 6, "TEMPERATURE": 0.0}) for i in range(30)]
    results = []
    for start in range(0, len(jobs), 10):  # P's copy counter decides which fail; all must be accounted
        results += run_concurrent(faulty.url, "tts", jobs[start : start + 10], timeout_s=60)
    failed = [r for r in results if r.error is not None]
    ok = [r for r in results if r.error is None]
    assert failed and ok
    for r in ok:
        assert r.rows.shape == (6, TINY_W)
    for r in failed:
        assert "KV transfer" in r.error, r.error
        # D's deadline is 0.5 s: the client hears of the failure within deadline + 1 s of sending.
        assert (r.done_ns - r.sent_ns) / 1e9 < 1.5, r
    text = metrics_text(faulty.metrics_url)
    assert metric_value(text, "tandem_kv_verifications_total", model="decode", result="mismatch") >= 1
    assert metric_value(text, "tandem_transfers_total", model="decode", outcome="failed") >= 1
    # Quarantine of the delayed copies ends only with proof (P's ABORT_ACK after its late copy).
    wait_metric(faulty.metrics_url, "tandem_held_pages", lambda v: v == 0, timeout_s=20, model="decode")
