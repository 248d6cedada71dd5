"""The gateway against hostile HTTP clients (idle sockets, huge bodies, malformed requests), through
the real `tandem-gateway` process pointed at a Triton address nobody listens on: every case here
is decided by the HTTP server or the app before a request would reach Triton (a valid speech body
gets 503 UNAVAILABLE). Small caps and timeouts make each bound cheap to reach; the full-scale
figures (20,000 idle connections, the default limits) come from `tandem-bench-gateway-abuse`
(docs/abuse.md, "The gateway"). Latency bounds are against a baseline taken in the same test.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.bench.http_abuse import IdleHolder, RssSampler, big_bodies, first_byte, parse_status
from tandem.gateway.connection_guard import FD_RESERVE, ServerLimits, effective
from tandem.gateway.limits import SPEECH_BODY_BYTES
from tandem.gateway.voices import UPLOAD_CEILING
from tests.support.gateway_process import GatewayProc, gateway_alone

CAP, PER_CLIENT, HEAD_S, BODY_S = 48, 16, 2.0, 2.0
FLAGS = [
    f"--max-connections={CAP}",
    f"--max-connections-per-client={PER_CLIENT}",
    f"--header-timeout={HEAD_S}",
    f"--body-timeout={BODY_S}",
]
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    with gateway_alone(tmp_path_factory.mktemp("gateway-abuse"), FLAGS) as g:
        yield g


def _raw(port: int, data: bytes, timeout_s: float = 15.0) -> tuple[int, dict[str, Any], float]:
    """Send `data`, read to the server's close or a whole response: (status, JSON body, seconds)."""
    t0 = time.perf_counter()
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(data)
        got = b""
        while True:
            try:
                more = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not more:
                break
            got += more
            head, _, body = got.partition(b"\r\n\r\n")
            length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
            if length and len(body) >= int(length[0].split(b":")[1]):
                break
    elapsed = time.perf_counter() - t0
    body = got.partition(b"\r\n\r\n")[2]
    return parse_status(got), (json.loads(body) if body else {}), elapsed


def _request(method: str, path: str, body: bytes = b"", ctype: str = "application/json") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
    if body or method == "POST":
        head += f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def _speech(**fields: Any) -> bytes:
    return json.dumps({"model": "tts", "input": "Hello.", "voice": "tara", **fields}).encode()


def _baseline(port: int, n: int = 5) -> float:
    """The slowest of `n` bystander requests now (what the bounds below add to)."""
    return max(first_byte(HOST, port)[0] for _ in range(n))


# ---- every error in OpenAI's shape --------------------------------------------------------------

LONE = b'"\\udfff"'  # a lone surrogate, escaped as JSON allows
ERRORS = {
    "GET on the speech route": (_request("GET", "/v1/audio/speech"), 405, None),
    "DELETE on /v1/models": (_request("DELETE", "/v1/models"), 405, None),
    "no such route": (_request("GET", "/v1/nope"), 404, None),
    "voice a lone surrogate": (
        _request("POST", "/v1/audio/speech", b'{"model": "tts", "input": "Hi.", "voice": ' + LONE + b"}"),
        400,
        "voice",
    ),
    "voice id a lone surrogate": (
        _request(
            "POST", "/v1/audio/speech", b'{"model": "tts", "input": "Hi.", "voice": {"id": ' + LONE + b"}}"
        ),
        400,
        "voice",
    ),
    "input a lone surrogate": (
        _request("POST", "/v1/audio/speech", b'{"model": "tts", "voice": "tara", "input": ' + LONE + b"}"),
        400,
        "input",
    ),
    "JSON nested 30,000 deep": (_request("POST", "/v1/audio/speech", b"[" * 30000 + b"]" * 30000), 400, None),
    "not JSON": (_request("POST", "/v1/audio/speech", b"{model"), 400, None),
    "input missing": (
        _request("POST", "/v1/audio/speech", b'{"model": "tts", "voice": "tara"}'),
        400,
        "input",
    ),
    "malformed HTTP": (b"BLAH\r\n\r\n", 400, None),
    "a header line over 16 KiB": (
        b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n",
        400,
        None,
    ),
    "valid, Triton absent": (_request("POST", "/v1/audio/speech", _speech()), 503, None),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_every_error_is_openai_json(gw: GatewayProc, case: str) -> None:
    data, want_status, want_param = ERRORS[case]
    status, body, _ = _raw(gw.port, data)
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == want_param and err["message"], err
    assert err["code"] == {404: "NOT_FOUND", 503: "UNAVAILABLE"}.get(status, "INVALID_ARG")


def test_a_lone_surrogate_is_counted_as_a_400(gw: GatewayProc) -> None:
    before = gw.metric("tandem_gateway_requests_total", status="400")
    for _ in range(3):
        assert _raw(gw.port, ERRORS["voice a lone surrogate"][0])[0] == 400
    assert gw.metric("tandem_gateway_requests_total", status="400") == before + 3
    assert gw.metric("tandem_gateway_requests_total", status="500") == 0


# ---- idle connections ---------------------------------------------------------------------------


def test_one_client_holding_idle_connections_does_not_starve_a_bystander(gw: GatewayProc) -> None:
    """400 slowloris connections from 127.0.0.2 (a header byte a second): 16 are admitted and cut
    with 408 at the header timeout, the rest answered 503 at once; a bystander from 127.0.0.1 is
    served meanwhile; the refusals are logged once, not 384 times."""
    base = _baseline(gw.port)
    cut = {
        r: gw.metric("tandem_gateway_connections_cut_total", reason=r)
        for r in ("client_cap", "header_timeout")
    }
    log_before = gw.log.read_text().count("(per client)")
    holder = IdleHolder(HOST, gw.port, 400, src="127.0.0.2", hold_s=HEAD_S + 4).start()
    try:
        holder.wait_ready()
        during = []
        for _ in range(10):
            during.append(first_byte(HOST, gw.port))
            time.sleep(0.05)
        report = holder.report()
    finally:
        holder.kill()
    worst = max(t for t, _ in during)
    print(
        f"\nidle holder: {report}\nbystander first byte: baseline max {base * 1e3:.1f} ms; while held"
        f" median {statistics.median(t for t, _ in during) * 1e3:.1f} ms, max {worst * 1e3:.1f} ms"
    )
    assert {s for _, s in during} == {200}
    assert worst <= base + 0.5
    opened = report.opened
    assert report.answered == {"503": opened - PER_CLIENT, "408": PER_CLIENT}, report
    assert report.closed_silently == 0 and report.still_open == 0
    assert gw.metric("tandem_gateway_connections_cut_total", reason="client_cap") == cut["client_cap"] + (
        opened - PER_CLIENT
    )
    assert gw.metric("tandem_gateway_connections_cut_total", reason="header_timeout") == cut[
        "header_timeout"
    ] + (PER_CLIENT)
    assert gw.log.read_text().count("(per client)") - log_before <= 2  # said once a window, with a count
    assert gw.metric("tandem_gateway_connections") <= 1  # only the metrics request itself


def test_past_the_cap_a_connection_gets_503_at_once_and_then_is_served_again(gw: GatewayProc) -> None:
    """Four clients of 16 connections each (64) against a cap of 48: 16 refused; a bystander gets
    the 503 at once while the cap is full and a 200 once the header timeout freed it."""
    base = _baseline(gw.port)
    holders = [
        IdleHolder(HOST, gw.port, PER_CLIENT, src=f"127.0.0.{3 + i}", hold_s=HEAD_S + 3).start()
        for i in range(4)
    ]
    try:
        for h in holders:
            h.wait_ready()
        t_full, status_full = first_byte(HOST, gw.port)
        reports = [h.report() for h in holders]
    finally:
        for h in holders:
            h.kill()
    status_after = first_byte(HOST, gw.port)[1]
    refused = sum(r.refused_503 for r in reports)
    timed_out = sum(r.answered.get("408", 0) for r in reports)
    print(
        f"\ncap {CAP}: {refused} refused, {timed_out} cut at the header timeout;"
        f" bystander {status_full} in {t_full * 1e3:.1f} ms"
    )
    assert refused == 4 * PER_CLIENT - CAP and timed_out == CAP
    assert status_full == 503 and t_full <= base + 0.5
    assert status_after == 200


def test_a_silent_connection_is_closed_at_the_header_timeout(gw: GatewayProc) -> None:
    t0 = time.perf_counter()
    with socket.create_connection((HOST, gw.port), timeout=HEAD_S + 10) as s:
        assert s.recv(100) == b""
    assert HEAD_S - 0.3 <= time.perf_counter() - t0 <= HEAD_S + 5


def test_a_body_shorter_than_its_content_length_gets_408_at_the_body_timeout(gw: GatewayProc) -> None:
    head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: 1000\r\n\r\n"
    counted = gw.metric("tandem_gateway_requests_total", status="400")
    cut = gw.metric("tandem_gateway_connections_cut_total", reason="body_timeout")
    status, body, elapsed = _raw(gw.port, head + b'{"model": ')
    print(f"\nshort body: {status} after {elapsed:.2f} s")
    assert status == 408 and "body" in body["error"]["message"]
    assert BODY_S - 0.3 <= elapsed <= BODY_S + 5
    assert gw.metric("tandem_gateway_connections_cut_total", reason="body_timeout") == cut + 1
    assert gw.metric("tandem_gateway_requests_total", status="400") == counted  # not also a 400


# ---- huge bodies --------------------------------------------------------------------------------

BODIES = {
    "speech, Content-Length 100 MB": ("/v1/audio/speech", False, "application/json", SPEECH_BODY_BYTES),
    "speech, chunked 100 MB": ("/v1/audio/speech", True, "application/json", SPEECH_BODY_BYTES),
    "voices, Content-Length 100 MB": ("/v1/voices", False, "multipart/form-data; boundary=b", UPLOAD_CEILING),
}


@pytest.mark.parametrize("case", list(BODIES))
def test_eight_huge_bodies_are_refused_before_they_are_read(gw: GatewayProc, case: str) -> None:
    path, chunked, ctype, limit = BODIES[case]
    base = _baseline(gw.port)
    with RssSampler(gw.proc.pid) as rss:
        results = big_bodies(HOST, gw.port, path, n=8, size=100 * 10**6, chunked=chunked, content_type=ctype)
    worst = max(r.first_byte_s for r in results)
    print(
        f"\n{case}: statuses {[r.status for r in results]}, time to the answer max {worst * 1e3:.1f} ms,"
        f" sent before it max {max(r.sent_bytes for r in results) / 1e6:.1f} MB,"
        f" RSS +{rss.growth / 2**20:.1f} MiB"
        f" (before {rss.before / 2**20:.0f} MiB)"
    )
    assert [r.status for r in results] == [413] * 8, [r.message for r in results]
    assert all(str(limit) in r.message for r in results), results[0].message
    assert worst <= 1.0 + base
    assert rss.growth <= 50 * 2**20
    assert _raw(gw.port, _request("GET", "/v1/models"))[0] == 200


def test_a_client_that_sends_its_whole_body_before_reading_gets_the_413(gw: GatewayProc) -> None:
    """urllib's way: `Connection: close`, all 10 MB, then read. uvicorn alone closed the connection
    right after its early answer and the client got a broken pipe."""
    req = urllib.request.Request(
        f"{gw.base}/v1/audio/speech", b"x" * 10**7, {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413 and json.load(e.value)["error"]["code"] == "INVALID_ARG"


def test_nothing_above_went_wrong_inside_the_gateway(gw: GatewayProc) -> None:
    log = gw.log.read_text()
    assert "Traceback" not in log and "Exception in" not in log, log[-4000:]
    assert gw.proc.poll() is None


# ---- the open-files limit -----------------------------------------------------------------------


def test_a_low_open_files_limit_clamps_the_cap_and_nothing_floods_the_log(tmp_path: Any) -> None:
    """With RLIMIT_NOFILE 160 and --max-connections 10000 the cap is clamped below 160 open files:
    300 connections from one client never run the gateway out of descriptors."""
    nofile = 160
    # The small backlog of a small cap slows the client's connects (~25 a second here): a header
    # timeout of 6 s keeps more than the cap waiting at once, so the cap is met, not only the timeout.
    head_s = 6.0
    bare = effective(ServerLimits(max_connections=10000), nofile).max_connections
    with gateway_alone(
        tmp_path, ["--max-connections=10000", f"--header-timeout={head_s}"], nofile=nofile
    ) as g:
        holder = IdleHolder(HOST, g.port, 300, src="127.0.0.2", hold_s=head_s + 3).start()
        try:
            holder.wait_ready()
            report = holder.report()
        finally:
            holder.kill()
        status_after = first_byte(HOST, g.port)[1]
        log = g.log.read_text()
    got = re.search(r"at most (\d+) connections", log)
    assert got is not None and f"open-files limit {nofile}" in log, log[-2000:]
    cap = int(got.group(1))
    print(f"\nnofile {nofile}: cap {cap}; {report}")
    assert cap + FD_RESERVE < bare + FD_RESERVE < nofile  # the files open at start are left room too
    # Every connection was answered: refused at once, or admitted (the cap filled) and cut at the
    # header timeout; a connect the small listen backlog delayed past a cut may be admitted later.
    assert report.closed_silently == 0 and sum(report.answered.values()) == report.opened == 300, report
    assert set(report.answered) == {"503", "408"} and report.answered["408"] >= cap, report
    assert status_after == 200
    assert "Too many open files" not in log and "out of system resource" not in log
    assert "Traceback" not in log, log[-4000:]
    assert log.count("refused a connection") <= 2
