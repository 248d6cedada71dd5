"""The stream-input WebSocket held for a whole call, through the real tritonserver and the real
gateway: no HTTP deadline on the socket, pings and `keepalive` as activity, a per-socket
`inactivity_timeout`, a complete sentence spoken after a short quiet, contexts (their own turns,
cancel, close), JSON audio with segment times, `speed` per turn, and what each bad frame gets.

One gateway for the module with `--body-timeout` cut to `BODY_TIMEOUT_S`: the HTTP body deadline
that used to cut every socket is 60 s by default, so a socket that outlives many of these shows it no
longer applies. The checked-in tiny model has no end-of-speech: every segment is
`Limits.default_new_rows` (256) rows of 1,050 samples at 22,050 Hz.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.settings import Limits
from tandem.gateway.session import segments
from tests.support.gateway_process import gateway_process
from tests.support.helpers import metric_value
from tests.support.server import TritonProcess
from tests.support.ws_turns import until_turn_done

RATE = 22050
ROWS = Limits().default_new_rows
SEGMENT_SAMPLES = ROWS * VocoderConfig().samples_per_row
BODY_TIMEOUT_S = 3.0  # the HTTP body deadline; 60 s by default
COMPRESSION = 60.0 / BODY_TIMEOUT_S  # a call's seconds per test second (the compressed clock)


@pytest.fixture(scope="module")
def gateway(server: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = [f"--body-timeout={BODY_TIMEOUT_S}"]
    with gateway_process(server, tmp_path_factory.mktemp("stream-input"), extra_args=args) as base:
        yield base


def _ws(gateway: str, ping_interval: float | None = None) -> ClientConnection:
    url = gateway.replace("http://", "ws://") + "/v1/audio/speech/stream-input"
    return connect(url, max_size=None, ping_interval=ping_interval)


def _send(ws: ClientConnection, **frame: Any) -> None:
    ws.send(json.dumps(frame))


def _event(ws: ClientConnection, timeout: float = 60.0) -> dict[str, Any]:
    msg = ws.recv(timeout=timeout)
    assert isinstance(msg, str), "a binary frame where an event was expected"
    return json.loads(msg)


def _configure(ws: ClientConnection, **extra: Any) -> dict[str, Any]:
    _send(ws, type="config", model="tts_mono", voice="tara", response_format="pcm", **extra)
    ready = _event(ws)
    assert ready["type"] == "ready", ready
    return ready


def _cuts(gateway: str, reason: str) -> float:
    with urllib.request.urlopen(f"{gateway}/metrics", timeout=10) as r:
        text = r.read().decode()
    try:
        return metric_value(text, "tandem_gateway_connections_cut_total", reason=reason)
    except KeyError:
        return 0.0


def _closed_code(ws: ClientConnection, timeout: float = 10.0) -> int | None:
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=timeout)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


# ---- a socket for a whole call --------------------------------------------------------------------


def test_a_socket_lives_through_3_idle_minutes_on_pings(gateway):
    """Real time: the default inactivity_timeout (60 s) thrice over, and the HTTP body deadline (3 s
    here) sixty times over, with nothing but the client library's pings every 20 s; then it speaks."""
    with _ws(gateway, ping_interval=20) as ws:
        assert _configure(ws)["inactivity_timeout"] == 60
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # nothing comes: no error, no close
            ws.recv(timeout=185)
        _send(ws, type="text", text="Still here after three minutes.")
        _send(ws, type="flush")
        audio, done, others = until_turn_done(ws)
        assert others == [] and not done["cancelled"] and len(audio) == 2 * SEGMENT_SAMPLES
        print(f"socket held {time.monotonic() - t0:.0f} s on pings, then spoke")
    assert _cuts(gateway, "body_timeout") == 0


def test_past_its_inactivity_timeout_a_socket_gets_an_error_and_a_close_code(gateway):
    with _ws(gateway) as ws:  # no pings
        _configure(ws, inactivity_timeout=2)
        t0 = time.monotonic()
        e = _event(ws, timeout=15)
        waited = time.monotonic() - t0
        assert (e["type"], e["code"]) == ("error", "UNAVAILABLE") and "no frame for 2 s" in e["message"]
        assert _closed_code(ws) == 1008
    assert 1.9 <= waited < 6, waited


def test_pings_and_keepalive_frames_are_activity(gateway):
    """inactivity_timeout 2 s: 5 s of client pings, then 5 s of keepalive frames keep the socket; then
    silence closes it."""
    with _ws(gateway) as ws:
        _configure(ws, inactivity_timeout=2)
        for _ in range(10):
            ws.ping()
            with pytest.raises(TimeoutError):  # the pacing: nothing arrives meanwhile
                ws.recv(timeout=0.5)
        for _ in range(10):
            _send(ws, type="keepalive")
            with pytest.raises(TimeoutError):
                ws.recv(timeout=0.5)
        assert _event(ws, timeout=10)["code"] == "UNAVAILABLE"
        assert _closed_code(ws) == 1008


def test_a_10_minute_call_on_a_compressed_clock(gateway):
    """A call of turns with the pauses of a real one, every duration divided by `COMPRESSION` (20:
    the body deadline is 3 s, the socket's inactivity_timeout 3 s): a turn every 12 call-seconds,
    pauses of 40 s (under the idle limit), of 100 s on pings, of 100 s on keepalive frames, for
    600 call-seconds. Every turn speaks whole; the socket is never cut."""
    idle_s = 60 / COMPRESSION
    call_s = 600 / COMPRESSION
    turns = 0
    with _ws(gateway) as ws:
        _configure(ws, inactivity_timeout=idle_s)
        t0 = time.monotonic()
        while time.monotonic() - t0 < call_s:
            _send(ws, type="text", text=f"Turn {turns} of the call.")
            _send(ws, type="flush")
            audio, done, others = until_turn_done(ws)
            assert others == [] and done["turn"] == turns and not done["cancelled"], (done, others)
            assert len(audio) == 2 * SEGMENT_SAMPLES
            turns += 1
            pause = [12, 40, 100, 100][turns % 4] / COMPRESSION
            end = time.monotonic() + pause
            while (left := end - time.monotonic()) > 0:  # the caller thinks; the agent keeps it alive
                if turns % 4 == 2:
                    ws.ping()
                elif turns % 4 == 3:
                    _send(ws, type="keepalive")
                with pytest.raises(TimeoutError):
                    ws.recv(timeout=min(left, idle_s / 3) if turns % 4 in (2, 3) else left)
        print(f"{turns} turns over {(time.monotonic() - t0) * COMPRESSION:.0f} call-seconds")
    assert turns >= 6 and _cuts(gateway, "body_timeout") == 0


# ---- a sentence speaks when it is done --------------------------------------------------------


def test_a_lone_sentence_speaks_after_a_short_quiet_and_an_abbreviation_waits(gateway):
    """First audio after a lone complete sentence and a pause (no flush), against the same sentence
    flushed; printed (docs/operations.md quotes it). "I met Dr. " is no complete sentence: silent
    until the rest comes, then one segment."""
    quiet, flushed = [], []
    with _ws(gateway) as ws:
        _configure(ws)
        for i in range(5):
            t0 = time.perf_counter()
            _send(ws, type="text", text=f"Hello number {i}. ")
            first = ws.recv(timeout=30)  # no flush, nothing more: the quiet speaks it
            quiet.append(time.perf_counter() - t0)
            assert isinstance(first, bytes)
            _send(ws, type="flush")
            _, done, _ = until_turn_done(ws)
            assert done["usage"]["segments"] == 1
            t0 = time.perf_counter()
            _send(ws, type="text", text=f"Hello number {i}.")
            _send(ws, type="flush")
            assert isinstance(ws.recv(timeout=30), bytes)
            flushed.append(time.perf_counter() - t0)
            until_turn_done(ws)
        _send(ws, type="text", text="I met Dr. ")
        with pytest.raises(TimeoutError):  # not a sentence yet: nothing is spoken
            ws.recv(timeout=2)
        _send(ws, type="text", text="Smith today.")
        _send(ws, type="flush")
        audio, done, _ = until_turn_done(ws)
        assert done["usage"] == {"output_tokens": ROWS, "segments": 1} and len(audio) == 2 * SEGMENT_SAMPLES
    q, f = statistics.median(quiet), statistics.median(flushed)
    print(
        f"first audio, tts_mono, CPU: a lone sentence and a pause {q * 1e3:.0f} ms (median of 5; "
        f"{min(quiet) * 1e3:.0f}-{max(quiet) * 1e3:.0f}), flushed {f * 1e3:.0f} ms "
        f"({min(flushed) * 1e3:.0f}-{max(flushed) * 1e3:.0f})"
    )
    assert q >= 0.2  # the quiet itself


# ---- contexts, JSON audio, speed --------------------------------------------------------------


def _json_turns(ws: ClientConnection, until: int, timeout: float = 120.0) -> dict[str, list[dict]]:
    """Every event per context_id ("" for the default context) until `until` turn_done have come."""
    out: dict[str, list[dict]] = {}
    done = 0
    while done < until:
        event = _event(ws, timeout)
        out.setdefault(event.get("context_id", ""), []).append(event)
        done += event["type"] == "turn_done"
    return out


def _pcm(events: list[dict]) -> bytes:
    return b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "audio")


def test_contexts_speak_their_own_turns_and_cancel_alone(gateway):
    """Context "reply" cancelled mid-speech ends at once and the other context's turn is whole; a
    closed context is answered with context_closed and its name is free again; turns count per
    context."""
    long_text = "This reply goes on and on. " * 44
    with _ws(gateway) as ws:
        _configure(ws, audio="json")
        _send(ws, type="text", text=long_text, context_id="reply")
        _send(ws, type="flush", context_id="reply")
        first = _event(ws)
        assert (first["type"], first["context_id"], first["turn"]) == ("audio", "reply", 0)
        _send(ws, type="cancel", context_id="reply")  # the caller barged in
        _send(ws, type="text", text="Next answer.", context_id="next")
        _send(ws, type="flush", context_id="next")
        got = _json_turns(ws, until=2)
        (reply_done,) = [e for e in got["reply"] if e["type"] == "turn_done"]
        assert reply_done["cancelled"], reply_done
        assert reply_done["usage"]["output_tokens"] < len(segments(long_text)) * ROWS  # the rest never ran
        next_done = got["next"][-1]
        assert next_done == {
            "type": "turn_done",
            "turn": 0,
            "cancelled": False,
            "usage": {"output_tokens": ROWS, "segments": 1},
            "context_id": "next",
        }
        assert len(_pcm(got["next"])) == 2 * SEGMENT_SAMPLES
        _send(ws, type="close_context", context_id="reply")
        assert _event(ws) == {"type": "context_closed", "context_id": "reply"}
        _send(ws, type="text", text="Reopened.", context_id="reply")  # a new context of that name
        _send(ws, type="flush", context_id="reply")
        _send(ws, type="text", text="Second turn.", context_id="next")
        _send(ws, type="flush", context_id="next")
        got = _json_turns(ws, until=2)
        assert [e["turn"] for e in got["reply"] if e["type"] == "turn_done"] == [0]
        assert [e["turn"] for e in got["next"] if e["type"] == "turn_done"] == [1]


def test_json_audio_carries_each_segments_text_and_its_exact_offsets(gateway):
    text = "The first sentence speaks alone. Then the second one. And a third to end it."
    with _ws(gateway) as ws:
        _configure(ws, audio="json")
        _send(ws, type="text", text=text)  # the default context: no context_id on its frames
        _send(ws, type="flush")
        events = _json_turns(ws, until=1)[""]
    pcm, starts = b"", {}
    for e in (e for e in events if e["type"] == "audio"):
        seg = e["segment"]
        start, _ = starts.setdefault(seg["index"], (len(pcm), seg["text"]))  # its first frame: here
        assert seg["start_s"] == pytest.approx(start / 2 / RATE, abs=1e-6)
        pcm += base64.b64decode(e["audio"])
        assert seg["end_s"] == pytest.approx(len(pcm) / 2 / RATE, abs=1e-6)  # the audio so far
    texts = [t for _, t in starts.values()]
    assert list(starts) == list(range(len(texts))) and texts[0] == "The first sentence speaks alone."
    assert " ".join(texts) == text  # every sentence in one segment or another, in order
    assert len(pcm) == len(texts) * 2 * SEGMENT_SAMPLES and events[-1]["usage"]["segments"] == len(texts)


def test_speed_is_per_turn_from_config_or_the_turns_first_text(gateway):
    with _ws(gateway) as ws:
        _configure(ws, audio="json", speed=2.0)
        _send(ws, type="text", text="Twice as fast.")
        _send(ws, type="flush")
        fast = _json_turns(ws, until=1)[""]
        _send(ws, type="text", text="At its own pace.", speed=1.0)
        _send(ws, type="text", text=" Still.", speed=0.5)  # a turn's speed is its first text's
        e = _event(ws)
        assert (e["code"], e["param"]) == ("INVALID_ARG", "speed") and "first text sets it" in e["message"]
        _send(ws, type="flush")
        plain = _json_turns(ws, until=1)[""]
    fast_s, plain_s = len(_pcm(fast)) / 2 / RATE, len(_pcm(plain)) / 2 / RATE
    assert plain_s == pytest.approx(SEGMENT_SAMPLES / RATE)
    assert fast_s == pytest.approx(plain_s / 2, rel=0.02)
    last = [e for e in fast if e["type"] == "audio"][-1]["segment"]
    assert last["end_s"] == pytest.approx(fast_s, abs=0.05)  # atempo's timeline, within its filter


# ---- what each bad frame gets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "param", "needle"),
    [
        ({"inactivity_timeout": 0.5}, "inactivity_timeout", "greater than or equal to 1"),
        ({"inactivity_timeout": 601}, "inactivity_timeout", "less than or equal to 600"),
        ({"audio": "base64"}, "audio", "'binary' or 'json'"),
    ],
)
def test_a_bad_config_is_refused_naming_the_field_and_a_good_one_follows(gateway, config, param, needle):
    with _ws(gateway) as ws:
        _send(ws, type="config", model="tts_mono", voice="tara", **config)
        e = _event(ws)
        assert (e["type"], e["code"], e["param"]) == ("error", "INVALID_ARG", param) and needle in e[
            "message"
        ]
        assert _configure(ws)["inactivity_timeout"] == 60


def test_bad_frames_each_get_an_error_and_the_socket_goes_on(gateway):
    with _ws(gateway) as ws, _ws(gateway) as binary:
        _configure(ws, audio="json")

        def refused(param: str, needle: str, **frame: Any) -> None:
            _send(ws, **frame)
            e = _event(ws)
            assert (e["type"], e["code"], e["param"]) == ("error", "INVALID_ARG", param), (frame, e)
            assert needle in e["message"], (frame, e)

        types = "config, text, flush, cancel, close_context, keepalive, close"
        refused("type", f"type 'shout' is not one of {types}", type="shout")
        refused("context_id", "at least 1 character", type="text", text="x", context_id="")
        refused("context_id", "should match pattern", type="text", text="x", context_id="a b")
        refused("context_id", "at most 64 characters", type="flush", context_id="c" * 65)
        refused("context_id", "valid string", type="cancel", context_id=5)
        refused("context_id", "no open context 'ghost'", type="cancel", context_id="ghost")
        refused("context_id", "no open context 'ghost'", type="close_context", context_id="ghost")
        for i in range(5):  # the default context counts among the 5 once opened; not yet
            _send(ws, type="text", text=f"Context {i} waits", context_id=f"c{i}")  # no sentence yet
        refused("context_id", "5 contexts are open; the limit is 5", type="text", text="six", context_id="c5")
        _send(ws, type="close_context", context_id="c0")
        got = _json_turns(ws, until=1)  # c0's open turn, cancelled, then context_closed
        usage = {"output_tokens": 0, "segments": 0}
        assert got == {
            "c0": [{"type": "turn_done", "turn": 0, "cancelled": True, "usage": usage, "context_id": "c0"}]
        }
        assert _event(ws) == {"type": "context_closed", "context_id": "c0"}
        _send(ws, type="text", text="A sixth speaks now.", context_id="c5")  # c0's slot is free
        _send(ws, type="flush", context_id="c5")
        got = _json_turns(ws, until=1)
        assert got["c5"][-1]["cancelled"] is False and len(_pcm(got["c5"])) == 2 * SEGMENT_SAMPLES

        _configure(binary)  # binary audio cannot tell contexts apart
        _send(binary, type="text", text="x", context_id="a")
        e = _event(binary)
        assert e["param"] == "context_id" and 'needs config audio "json"' in e["message"]
        _send(binary, type="keepalive")  # accepted, answered by nothing
        _send(binary, type="text", text="The default context speaks.")
        _send(binary, type="flush")
        audio, done, others = until_turn_done(binary)
        assert others == [] and "context_id" not in done and len(audio) == 2 * SEGMENT_SAMPLES
