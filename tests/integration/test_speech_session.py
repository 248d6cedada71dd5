"""Speech sessions through the real tritonserver and the real gateway: long inputs spoken
whole in pipelined segments, every OpenAI format decoded back with PyAV, speed, seed, the refusals,
and the stream-input WebSocket (turns, text in pieces, cancel, errors).

One gateway process for the module (idle timeout of WebSockets cut to `WS_IDLE_S`). The checked-in
tiny model has no end-of-speech: every segment streams `Limits.default_new_rows` (256) rows of
1,050 samples at 22,050 Hz, so a text's audio is exactly `segments(text)` x that.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from typing import Any

import av
import openai
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.settings import Limits
from tandem.gateway.audio import pcm16
from tandem.gateway.client import TTSClient
from tandem.gateway.session import segments
from tests.support.gateway_process import gateway_process, http_post
from tests.support.helpers import settled_metric, wait_metric
from tests.support.server import TritonProcess
from tests.support.ws_turns import until_turn_done

RATE = 22050
ROWS = Limits().default_new_rows
SEGMENT_SAMPLES = ROWS * VocoderConfig().samples_per_row
MAX_STREAM_SAMPLES = Limits().max_new_rows * VocoderConfig().samples_per_row  # one stream's most audio
WS_IDLE_S = 3.0
LONG_ROWS = Limits().max_new_rows  # `long_unit`'s streams
LONG = {"tandem.limits.default_new_rows": str(LONG_ROWS)}
OUTCOMES = ("finished", "cancelled", "failed")
SHORT = "Hello there."


def _long_text(chars: int) -> str:
    out, i = "", 0
    while len(out) < chars:
        out += f"Sentence {i} of the long input keeps going, with a clause or two, until it ends here. "
        i += 1
    return out[: chars - 1] + "."


@pytest.fixture(scope="module")
def gateway(server: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_process(
        server, tmp_path_factory.mktemp("speech-gateway"), extra_args=[f"--ws-idle-timeout={WS_IDLE_S}"]
    ) as base:
        yield base


@pytest.fixture(scope="module")
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=300)


def _speak(sdk: openai.OpenAI, text: str, **kw: Any) -> tuple[bytes, dict[str, str], float]:
    """(body, headers, seconds to the first body bytes)."""
    if "seed" in kw:  # tandem's extension: the SDK sends it as an extra body field
        kw["extra_body"] = {"seed": kw.pop("seed")}
    t0 = time.perf_counter()
    first = 0.0
    chunks = []
    with sdk.audio.speech.with_streaming_response.create(
        model=kw.pop("model", "tts"), input=text, voice=kw.pop("voice", "tara"), **kw
    ) as resp:
        for c in resp.iter_bytes():
            if c and not first:
                first = time.perf_counter() - t0
            chunks.append(c)
        return b"".join(chunks), dict(resp.headers), first


def _sse(body: bytes) -> tuple[bytes, dict[str, Any]]:
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: ")]
    audio = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    return audio, events[-1]


def _decode(data: bytes) -> tuple[int, int]:
    """(sample rate, samples) of a file, decoded by FFmpeg through PyAV."""
    with av.open(io.BytesIO(data)) as c:
        rate, n = 0, 0
        for frame in c.decode(c.streams.audio[0]):
            rate, n = frame.sample_rate, n + frame.samples
    return rate, n


# ---- HTTP ---------------------------------------------------------------------------------------


def test_4096_characters_are_spoken_whole_in_pipelined_segments(sdk):
    text = _long_text(4096)
    parts = segments(text)
    assert len(text) == 4096 and len(parts) > MAX_STREAM_SAMPLES // SEGMENT_SAMPLES
    _, _, short_first = _speak(sdk, SHORT, response_format="pcm")  # the baseline, same load
    body, headers, long_first = _speak(sdk, text, response_format="pcm", stream_format="sse")
    audio, done = _sse(body)
    usage = done.pop("usage")
    assert done == {"type": "speech.audio.done"} and usage["output_tokens"] == ROWS * len(parts)
    assert usage["input_tokens"] > len(parts)  # every segment's prompt rows
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert len(audio) == 2 * SEGMENT_SAMPLES * len(parts) > 2 * MAX_STREAM_SAMPLES
    assert int(headers["x-tandem-stream-id"]) > 0
    # the first segment is the first sentence alone: its first audio is a short input's
    print(f"first audio: short {short_first * 1e3:.0f} ms, 4,096 chars {long_first * 1e3:.0f} ms")
    assert long_first < 2 * short_first + 0.5


def test_the_first_segment_speaks_alone_first(sdk):
    """The session's audio starts with its first segment's stream, which starts alone: its first
    response (4 rows, before the second segment's stream exists) is the one-sentence request's.
    (Later audio is made with two streams in one decode batch, whose float sums on the CPU may round a
    logit apart from a lone stream's; the order itself is tested in tests/unit/test_speech_session.py.)"""
    a, b = "First sentence, spoken first.", "Second sentence, spoken second and longer than the first one."
    one, _, _ = _speak(sdk, a, response_format="pcm", seed=11)
    both, _, _ = _speak(sdk, f"{a} {b}", response_format="pcm", seed=11)
    assert segments(f"{a} {b}") == [a, b] and len(both) == 2 * len(one)
    head = 2 * 4 * VocoderConfig().samples_per_row
    assert both[:head] == one[:head]


def test_tts_client_speaks_a_text_as_the_gateway_does(server, sdk):
    """`TTSClient.speak` over gRPC: the same segments, voice and seed, the same audio as the HTTP route."""
    text = "First sentence, spoken first. Second sentence, spoken second and longer than the first one."
    with TTSClient(server.url, "tts_mono") as client:
        spoken = client.speak(text, voice="tara", seed=11)
    assert spoken.error is None and spoken.segments == segments(text) and len(spoken.results) == 2
    assert spoken.rows == 2 * ROWS
    over_http, _, _ = _speak(sdk, text, model="tts_mono", response_format="pcm", seed=11)
    assert len(pcm16(spoken.audio)) == len(over_http) == 2 * 2 * SEGMENT_SAMPLES
    assert (
        pcm16(spoken.audio)[: 2 * 4 * VocoderConfig().samples_per_row]
        == over_http[: 2 * 4 * VocoderConfig().samples_per_row]
    )


def test_4097_characters_are_a_400_naming_input(gateway):
    status, body = http_post(
        f"{gateway}/v1/audio/speech", {"model": "tts", "input": "x" * 4097, "voice": "tara"}
    )
    assert status == 400 and body["error"]["param"] == "input" and body["error"]["code"] == "INVALID_ARG"


@pytest.mark.parametrize(
    ("fmt", "content_type", "rate", "slack"),
    [
        ("mp3", "audio/mpeg", RATE, 2 * 1152),  # LAME's priming and last frame
        ("opus", "audio/opus", 48000, 960),  # Ogg Opus is 48 kHz; pre-skip removes the priming
        ("aac", "audio/aac", RATE, 2 * 1024),
        ("flac", "audio/flac", RATE, 0),
        ("wav", "audio/wav", RATE, 0),
    ],
)
def test_each_format_decodes_to_the_pcm_length(sdk, fmt, content_type, rate, slack):
    body, headers, _ = _speak(sdk, SHORT, response_format=fmt)
    assert headers["content-type"] == content_type
    got_rate, n = _decode(body)
    expected = round(SEGMENT_SAMPLES * rate / RATE)
    assert got_rate == rate and expected - 1 <= n <= expected + slack, (n, expected)


def test_mp3_is_the_default_and_streams(sdk):
    with sdk.audio.speech.with_streaming_response.create(model="tts", input=SHORT, voice="tara") as resp:
        assert resp.headers["content-type"] == "audio/mpeg"
        chunks = [c for c in resp.iter_bytes() if c]
    assert len(chunks) > 2 and _decode(b"".join(chunks))[0] == RATE


@pytest.mark.parametrize("speed", [2.0, 0.25])
def test_speed_stretches_the_audio(sdk, speed):
    pcm, _, _ = _speak(sdk, SHORT, response_format="pcm", speed=speed, seed=3)
    ratio = len(pcm) / 2 / SEGMENT_SAMPLES
    assert abs(ratio - 1 / speed) < 0.01 / speed, ratio
    flac, _, _ = _speak(sdk, SHORT, response_format="flac", speed=speed, seed=3)
    assert abs(_decode(flac)[1] - len(pcm) / 2) <= 1  # the same stretch through an encoder


def test_same_seed_same_audio(sdk):
    """One segment, one stream alone in the engines: the sampling seed fixes every sampled token."""
    text = "Same seed, same audio, in one sentence."
    a, _, _ = _speak(sdk, text, response_format="pcm", seed=1234)
    b, _, _ = _speak(sdk, text, response_format="pcm", seed=1234)
    c, _, _ = _speak(sdk, text, response_format="pcm", seed=1235)
    assert a == b and a != c


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"speed": 4.5}, "speed", "speed = 4.5: outside [0.25, 4]"),
        ({"speed": 0.2}, "speed", "speed = 0.2: outside [0.25, 4]"),
        ({"instructions": "Speak cheerfully."}, "instructions", "instructions are not supported"),
        ({"seed": 2**63}, "seed", "less than or equal"),
        ({"response_format": "ogg"}, "response_format", "Input should be"),
        ({"voice": "bob"}, "voice", "VOICE 'bob' is not one of this model's voices"),
    ],
)
def test_bad_requests_are_400_naming_the_field(gateway, extra, param, needle):
    status, body = http_post(
        f"{gateway}/v1/audio/speech", {"model": "tts", "input": SHORT, "voice": "tara", **extra}
    )
    assert status == 400 and body["error"]["param"] == param and body["error"]["code"] == "INVALID_ARG", body
    assert needle in body["error"]["message"], body


# ---- the stream-input WebSocket -------------------------------------------------------------------


def _ws(gateway: str) -> ClientConnection:
    return connect(gateway.replace("http://", "ws://") + "/v1/audio/speech/stream-input", max_size=None)


def _send(ws: ClientConnection, **frame: Any) -> None:
    ws.send(json.dumps(frame))


def _event(ws: ClientConnection, timeout: float = 60.0) -> dict[str, Any]:
    msg = ws.recv(timeout=timeout)
    assert isinstance(msg, str), "a binary frame where an event was expected"
    return json.loads(msg)


def test_ws_turns_speak_text_pieces_before_the_flush(gateway):
    with _ws(gateway) as ws:
        _send(ws, type="config", model="tts", voice="tara", response_format="pcm", seed=5)
        assert _event(ws) == {
            "type": "ready",
            "sample_rate": RATE,
            "format": "pcm",
            "audio": "binary",
            "inactivity_timeout": WS_IDLE_S,
        }
        for piece in ["Hel", "lo the", "re.", " How", " are"]:  # an LLM's tokens
            _send(ws, type="text", text=piece)
        first = ws.recv(timeout=60)  # the first sentence is complete: it speaks without a flush
        assert isinstance(first, bytes) and first
        _send(ws, type="text", text=" you today?")
        _send(ws, type="flush")
        rest, done, others = until_turn_done(ws)
        assert others == [] and done == {
            "type": "turn_done",
            "turn": 0,
            "cancelled": False,
            "usage": {"output_tokens": 2 * ROWS, "segments": 2},
        }
        assert len(first) + len(rest) == 2 * 2 * SEGMENT_SAMPLES
        _send(ws, type="text", text="A second turn.")
        _send(ws, type="flush")
        audio, done, _ = until_turn_done(ws)
        assert done["turn"] == 1 and not done["cancelled"] and len(audio) == 2 * SEGMENT_SAMPLES
        _send(ws, type="close")


def test_ws_each_turn_is_one_file_of_the_format(gateway):
    with _ws(gateway) as ws:
        _send(ws, type="config", model="tts_mono", voice="tara", response_format="opus")
        ready = _event(ws)
        assert (ready["type"], ready["sample_rate"], ready["format"]) == ("ready", 48000, "opus")
        _send(ws, type="text", text=SHORT)
        _send(ws, type="flush")
        audio, done, _ = until_turn_done(ws)
    assert done["usage"]["output_tokens"] == ROWS
    assert _decode(audio) == (48000, round(SEGMENT_SAMPLES * 48000 / RATE))


@pytest.fixture(scope="module")
def long_unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TritonProcess, str]]:
    """A server whose streams run `LONG_ROWS` rows by default (seconds each for the tiny model on a
    CPU, against 256 rows' fraction of a second), and a gateway over it: a stream in flight at a
    cancel is still decoding when the cancel lands, so only the cancel can end it soon."""
    proc = TritonProcess(tmp_path_factory.mktemp("long-streams"), {"prefill": LONG, "tts_mono": LONG})
    proc.start()
    try:
        with gateway_process(proc, tmp_path_factory.mktemp("long-gateway")) as base:
            yield proc, base
    finally:
        proc.stop()


@pytest.mark.parametrize(("model", "engine"), [("tts_mono", "tts_mono"), ("tts", "decode")])
def test_ws_cancel_ends_the_turns_streams_at_once(long_unit, model, engine):
    """The turn ends at once, no later segment starts, and the engine that decodes the turn's
    streams ends them cancelled: tts_mono is told by Triton, `tts`'s decode step by the gateway's
    CANCEL. Every segment streams `LONG_ROWS` rows, so the streams are still decoding when the cancel
    goes (the engine's in-flight gauge says so) and a cancel that did nothing would leave them to
    finish: counted finished, not cancelled."""
    server, gateway = long_unit
    url, text = server.metrics_url, _long_text(1200)
    parts = len(segments(text))
    outcomes = {o: settled_metric(url, "tandem_streams_total", model=engine, outcome=o) for o in OUTCOMES}

    with _ws(gateway) as ws:
        _send(ws, type="config", model=model, voice="tara", response_format="pcm")
        _event(ws)
        _send(ws, type="text", text=text)
        _send(ws, type="flush")
        assert isinstance(ws.recv(timeout=60), bytes)
        wait_metric(url, "tandem_inflight_streams", lambda v: v >= 1, model=engine)  # decoding now
        t0 = time.perf_counter()
        _send(ws, type="cancel")
        _, done, _ = until_turn_done(ws)
        latency = time.perf_counter() - t0
        assert done["cancelled"] is True and done["turn"] == 0
        print(f"cancel -> turn_done: {latency * 1e3:.0f} ms")
        # the engine's cancellation poll (0.5 s) and a worker beat (1 s) later, with room for a busy box
        wait_metric(url, "tandem_inflight_streams", lambda v: v == 0, timeout_s=5, model=engine)
        after = {o: settled_metric(url, "tandem_streams_total", model=engine, outcome=o) for o in OUTCOMES}
        assert after["cancelled"] > outcomes["cancelled"] and after["finished"] == outcomes["finished"], (
            outcomes,
            after,
        )
        assert done["usage"]["output_tokens"] < parts * LONG_ROWS, (
            done["usage"],
            parts,
        )  # the rest never ran
        _send(ws, type="text", text="After the cancel.")  # the socket goes on: a new turn
        _send(ws, type="flush")
        audio, done, _ = until_turn_done(ws)
        assert done["turn"] == 1 and not done["cancelled"]
        assert len(audio) == 2 * LONG_ROWS * VocoderConfig().samples_per_row


def test_ws_errors_name_what_is_wrong_and_hurt_no_other_socket(gateway):
    with _ws(gateway) as bad, _ws(gateway) as good:
        _send(good, type="config", model="tts", voice="tara", response_format="pcm")
        assert _event(good)["type"] == "ready"
        _send(good, type="text", text="The other socket speaks on. ")

        _send(bad, type="text", text="too early")
        e = _event(bad)
        assert (e["type"], e["code"], e["param"]) == (
            "error",
            "INVALID_ARG",
            "type",
        ) and "before config" in e["message"]
        bad.send("{not json")
        e = _event(bad)
        assert e["code"] == "INVALID_ARG" and e["message"].startswith("frame is not JSON")
        _send(bad, type="shout")
        e = _event(bad)
        assert e["param"] == "type" and "'shout' is not one of config, text" in e["message"]
        _send(bad, type="config", model="tts", voice="tara", response_format="pcm", speed=9)
        e = _event(bad)
        assert e["param"] == "speed" and "less than or equal to 4" in e["message"]
        _send(bad, type="config", model="nope", voice="tara")
        e = _event(bad)
        assert (e["code"], e["param"]) == ("NOT_FOUND", "model")
        bad.send(b"\x00\x01")
        assert "binary frames are not accepted" in _event(bad)["message"]
        _send(bad, type="config", model="tts", voice="bob", response_format="pcm")
        assert _event(bad)["type"] == "ready"
        _send(bad, type="config", model="tts", voice="tara")
        assert "config was sent already" in _event(bad)["message"]
        _send(bad, type="text")
        e = _event(bad)
        assert e["param"] == "text" and "Field required" in e["message"]
        _send(bad, type="text", text="x" * 9000)
        e = _event(bad)
        assert e["param"] == "text" and "the limit is 8192" in e["message"]
        _send(bad, type="text", text="Unknown voice.")
        _send(bad, type="flush")
        _, done, events = until_turn_done(bad)
        assert [(ev["code"], ev["param"], ev["turn"]) for ev in events] == [("INVALID_ARG", "voice", 0)]
        assert "VOICE 'bob' is not one" in events[0]["message"] and done["cancelled"] is True

        _send(good, type="flush")
        audio, done, others = until_turn_done(good)
        assert others == [] and not done["cancelled"] and len(audio) == 2 * SEGMENT_SAMPLES


def test_ws_idle_socket_gets_an_error_and_is_closed(gateway):
    with _ws(gateway) as ws:
        t0 = time.perf_counter()
        e = _event(ws, timeout=WS_IDLE_S + 10)
        assert (e["code"], e["type"]) == ("UNAVAILABLE", "error") and "no frame for 3 s" in e["message"]
        assert time.perf_counter() - t0 >= WS_IDLE_S - 0.5
        with pytest.raises(ConnectionClosed):  # closed by the server
            ws.recv(timeout=5)
