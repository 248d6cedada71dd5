"""The unit's health as read from Triton's metrics text, and the probe's exit codes."""

import http.server
import threading

import pytest

from tandem.cli.health import main as health_main
from tandem.serving.health import STUB_SILENT_S, HealthUnavailable, fetch_health, parse_health

UP = """\
# HELP tandem_engine_up 1 while the engine worker answers
# TYPE tandem_engine_up gauge
tandem_engine_up{model="prefill",model_instance="prefill_0_0"} 1
tandem_engine_up{model="decode",model_instance="decode_0_0"} 1
# HELP tandem_draining 1 while decode admits nothing new
# TYPE tandem_draining gauge
tandem_draining{model="decode",model_instance="decode_0_0"} 0
"""


def test_all_up_and_not_draining_is_ready():
    h = parse_health(UP)
    assert h.ready and h.engines_up and not h.draining
    assert h.reasons == ()
    assert {(e.model, e.model_instance) for e in h.engines} == {
        ("prefill", "prefill_0_0"),
        ("decode", "decode_0_0"),
    }


def test_an_engine_down_is_not_ready_and_named():
    h = parse_health(UP.replace('model_instance="prefill_0_0"} 1', 'model_instance="prefill_0_0"} 0'))
    assert not h.ready and not h.engines_up
    assert h.reasons == ("prefill prefill_0_0: engine down",)


def test_draining_is_not_ready_but_engines_are_up():
    h = parse_health(UP.replace('model_instance="decode_0_0"} 0', 'model_instance="decode_0_0"} 1'))
    assert h.engines_up and h.draining and not h.ready
    assert h.reasons == ("decode decode_0_0: draining",)


def test_no_engine_published_is_not_ready():
    h = parse_health("# TYPE nv_inference_count counter\nnv_inference_count 3\n")
    assert not h.ready
    assert "no tandem_engine_up" in h.reasons[0]


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = UP

    def do_GET(self):
        data = self.body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Metrics)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    srv.shutdown()


def test_probe_exit_codes(metrics_server, capsys):
    assert health_main(["--metrics-url", metrics_server]) == 0
    _Metrics.body = UP.replace('model_instance="decode_0_0"} 0', 'model_instance="decode_0_0"} 1')
    try:
        assert health_main(["--metrics-url", metrics_server]) == 1
        assert health_main(["--metrics-url", metrics_server, "--allow-draining"]) == 0
    finally:
        _Metrics.body = UP
    assert "draining" in capsys.readouterr().err


def test_unreachable_endpoint():
    with pytest.raises(HealthUnavailable):
        fetch_health("http://127.0.0.1:9/metrics", timeout_s=0.5)
    assert health_main(["--metrics-url", "http://127.0.0.1:9/metrics", "--timeout", "0.5"]) == 2


def test_a_silent_stub_is_not_ready_and_its_engine_is_down():
    """A dead stub's series stay at their last values (tandem_engine_up 1): its heartbeat, older than
    STUB_SILENT_S, is what says it is gone, for an engine model and for one without an engine."""
    beats = (
        "# TYPE tandem_stub_heartbeat_timestamp_seconds gauge\n"
        'tandem_stub_heartbeat_timestamp_seconds{model="decode",model_instance="decode_0_0"} 1000.0\n'
        'tandem_stub_heartbeat_timestamp_seconds{model="vocoder",model_instance="vocoder_0_0"} 1009.5\n'
    )
    fresh = parse_health(UP + beats, now=1001.0)
    assert fresh.ready and fresh.reasons == ()
    dead = parse_health(UP + beats, now=1000.0 + STUB_SILENT_S + 1)
    assert not dead.ready and not dead.engines_up
    assert dead.reasons == (
        "decode decode_0_0: stub silent for 5.0 s (dead or stopped)",
        "decode decode_0_0: engine down",
    )
    vocoder = parse_health(UP + beats, now=1009.5 + STUB_SILENT_S + 1)  # decode's beat is older still
    assert "vocoder vocoder_0_0: stub silent for 5.0 s (dead or stopped)" in vocoder.reasons


def test_the_units_own_clock_judges_heartbeats_read_from_another_host():
    """A reader whose clock is off (here by an hour) judges by the newest heartbeat: a stub 9.5 s
    behind it is silent, one at it is not; by the reader's clock both would be."""
    beats = (
        "# TYPE tandem_stub_heartbeat_timestamp_seconds gauge\n"
        'tandem_stub_heartbeat_timestamp_seconds{model="decode",model_instance="decode_0_0"} 1000.0\n'
        'tandem_stub_heartbeat_timestamp_seconds{model="vocoder",model_instance="vocoder_0_0"} 1009.5\n'
    )
    skewed = parse_health(UP + beats, now=1009.5 + 3600, unit_clock=True)
    assert skewed.silent_stubs == (("decode", "decode_0_0", 10.5),)
    assert len(parse_health(UP + beats, now=1009.5 + 3600).silent_stubs) == 2
