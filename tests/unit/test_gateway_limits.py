"""The gateway's pure pieces of its HTTP bounds: the log's repeat summary, the body limit each
route gets, the caps a small open-files limit leaves (the behaviour through the real process:
tests/process/test_gateway_abuse.py)."""

from __future__ import annotations

import logging

from starlette.types import Scope

from tandem.gateway.app import GatewaySettings, create_app
from tandem.gateway.connection_guard import FD_RESERVE, ServerLimits, effective
from tandem.gateway.limits import SPEECH_BODY_BYTES, route_limit
from tandem.gateway.logs import RepeatSummary
from tandem.gateway.voices import UPLOAD_CEILING


def _scope(method: str, path: str) -> Scope:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}


def test_each_route_has_its_body_limit() -> None:
    app = create_app(GatewaySettings("127.0.0.1:1", "http://127.0.0.1:1/metrics"))
    limit_of = route_limit(app.router.routes, SPEECH_BODY_BYTES)
    assert limit_of(_scope("POST", "/v1/audio/speech")) == SPEECH_BODY_BYTES
    assert limit_of(_scope("POST", "/v1/voices")) == UPLOAD_CEILING  # a route of an included router
    assert limit_of(_scope("GET", "/v1/models")) == SPEECH_BODY_BYTES  # no limit of its own
    assert limit_of(_scope("PUT", "/nowhere")) == SPEECH_BODY_BYTES


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_warning_is_said_once_a_window_with_the_count_held_back() -> None:
    clock = _Clock()
    summary = RepeatSummary(window_s=10.0, clock=clock)
    logger = logging.getLogger("test.repeats")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(summary)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    try:
        for i in range(70_000):
            clock.now = i * 1e-4  # 70,000 in 7 s
            logger.warning("accept failed for %s: Too many open files", f"peer{i}")
        logger.warning("another kind")
        logger.info("the access log is never held back")
        logger.info("the access log is never held back")
        clock.now = 12.0
        logger.warning("accept failed for %s: Too many open files", "late")
        logger.warning("accept failed for %s: Too many open files", "later")
        summary.flush(logger)
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records]
    assert lines[:4] == [
        "accept failed for peer0: Too many open files",
        "another kind",
        "the access log is never held back",
        "the access log is never held back",
    ]
    assert (
        lines[4] == "accept failed for late: Too many open files [and 69999 more like this in the last 12 s]"
    )
    assert len(lines) == 6 and "1 more like" in lines[5]  # "later", held back, said at the flush


def test_a_small_open_files_limit_leaves_the_reserve_free() -> None:
    for nofile in (160, 1024, 20_000, 1_048_576):
        lim = effective(ServerLimits(max_connections=10**6, max_per_client=10**6), nofile)
        assert lim.max_connections >= 1 and lim.max_per_client == lim.max_connections
        assert lim.max_connections + lim.linger_cap + lim.backlog + FD_RESERVE <= nofile
    assert effective(ServerLimits(), 20_000) == ServerLimits()  # the defaults fit 20,000 open files
