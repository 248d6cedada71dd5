"""`tandem-unit` brings a dead P back: real tritonserver under the supervisor, P's stub SIGKILLed.

Triton 2.51 does not restart a dead decoupled stub (docs/failure-semantics.md); the supervisor sees P's
slot lock free while `prefill` is loaded, bumps `prefill/1/model.py`'s mtime and loads `prefill` again.
Checks: requests fail while P is dead, serve again within ~30 s from a new P instance (new stub process,
new instance id), a stream already decoding on D when P died completes, the supervisor's log names the
restart, and SIGTERM to the supervisor stops the server with its status.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from tandem.cli.tts_client import TTSClient
from tandem.cli.unit import http_base, option_values, with_explicit_control
from tandem.serving.repository import get_parameter
from tests.integration.faults import Background, children, find_stub, process_state, stub_argv
from tests.integration.helpers import TINY_W, metric_value, metrics_text, prompt, run
from tests.integration.server import TritonProcess
from tests.integration.test_tts_faults import decode, handoff

GRACE_S = 2.0
LONG_ROWS = 2000


def _server_pid(unit_pid: int) -> int:
    for pid in children(unit_pid):
        argv = stub_argv(pid)
        if argv and argv[0].endswith("tritonserver"):
            return pid
    raise AssertionError(f"no tritonserver under tandem-unit {unit_pid}")


def _verified(url: str) -> float:
    try:
        return metric_value(metrics_text(url), "tandem_kv_verifications_total", model="decode", result="ok")
    except KeyError:
        return 0.0


def _instance(url: str) -> str:
    """P's instance id from a real handoff, which D then decodes (so no offer is left behind)."""
    text = handoff(url)
    out, err = decode(url, text)
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8, err
    return str(json.loads(text)["ticket"]["instance_id"])


def _long_stream(url: str) -> object:
    with TTSClient(url, "tts") as c:
        return c.run(prompt(30, seed=7), timeout_s=60, MAX_TOKENS=LONG_ROWS, TEMPERATURE=0.0)


def test_server_arguments() -> None:
    args = ["--model-repository", "/r", "--http-port=9000", "--grpc-port", "9001"]
    assert option_values(args, "--model-repository", "--model-store") == ["/r"]
    assert http_base(args) == "http://127.0.0.1:9000"
    assert http_base(["--http-address=10.0.0.5"]) == "http://10.0.0.5:8000"
    assert with_explicit_control(args)[-2:] == ["--model-control-mode=explicit", "--load-model=*"]
    assert with_explicit_control([*args, "--model-control-mode", "poll"]) == [
        *args,
        "--model-control-mode",
        "poll",
    ]
    cfg = 'parameters { key: "tandem.transfer.unit" value { string_value: "u7" } }\n'
    assert get_parameter(cfg, "tandem.transfer.unit") == "u7"
    assert get_parameter(cfg, "tandem.transfer.paths") is None


@pytest.mark.slow
def test_unit_reloads_a_killed_prefill(tmp_path: Path) -> None:
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path,
        # Triton keeps counting the dead instance as a live model at shutdown and would wait out its
        # 30 s exit timeout (docs/failure-semantics.md); 3 s keeps the test short.
        extra_args=("--exit-timeout-secs=3",),
        launcher=(str(unit_bin), "--restart-grace", str(GRACE_S), "--stop-timeout", "15", "--"),
    )
    shutil.rmtree(proc.repo / "tts_mono")  # not used here; saves a stub start
    proc.start()
    try:
        assert proc.proc is not None
        server = _server_pid(proc.proc.pid)
        url = proc.url
        r = run(url, "tts", prompt(40), MAX_TOKENS=10, TEMPERATURE=0.0)
        assert r.error is None and r.rows.shape == (10, TINY_W), r.error
        before = _instance(url)
        old_stub = find_stub(server, "prefill")
        assert old_stub is not None

        # A long stream whose KV has reached D (verified) before P dies: D keeps decoding it.
        verified = _verified(proc.metrics_url)
        long = Background(lambda: _long_stream(url))
        deadline = time.monotonic() + 20
        while _verified(proc.metrics_url) <= verified:
            assert time.monotonic() < deadline, "the long stream's KV never reached D"
            time.sleep(0.05)

        os.kill(old_stub, signal.SIGKILL)
        killed = time.monotonic()
        while find_stub(server, "prefill") == old_stub:
            time.sleep(0.05)
        time.sleep(0.3)

        t0 = time.monotonic()
        dead = run(url, "tts", prompt(20, seed=1), timeout_s=10, MAX_TOKENS=3, TEMPERATURE=0.0)
        assert dead.error is not None and "not healthy" in dead.error, dead.error
        assert time.monotonic() - t0 < 3.0, "a request to a dead P did not fail promptly"

        back = None
        while time.monotonic() - killed < 30:
            r = run(url, "tts", prompt(20, seed=2), timeout_s=20, MAX_TOKENS=5, TEMPERATURE=0.0)
            if r.error is None:
                back = time.monotonic() - killed
                assert r.rows.shape == (5, TINY_W)
                break
            assert "not healthy" in r.error, r.error
            time.sleep(0.5)
        assert back is not None, f"no tts request served within 30 s of P's death:\n{proc.log_tail()}"
        new_stub = find_stub(server, "prefill")
        assert new_stub is not None and new_stub != old_stub
        assert _server_pid(proc.proc.pid) == server, "the whole server was restarted, not just P"
        assert _instance(url) != before, "D decoded for the dead instance id"

        survivor = long.join(60)
        assert survivor.error is None, survivor.error
        assert survivor.rows.shape == (LONG_ROWS, TINY_W)

        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: restarting P (#1): slot lock p-prefill_0_0.lock free" in log, proc.log_tail()
        assert "bumped the mtime of" in log and "prefill/1/model.py" in log
        assert "tandem-unit: P restarted (#1): prefill reloaded in" in log
        print(f"\nP back {back:.1f} s after SIGKILL (grace {GRACE_S} s)")

        os.kill(proc.proc.pid, signal.SIGTERM)
        status = proc.proc.wait(30)
        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: SIGTERM: forwarding it to tritonserver" in log
        assert f"tandem-unit: tritonserver exited with status {status}\n" in log, proc.log_tail()
    finally:
        proc.stop()


def _proxy_pid(unit_pid: int) -> int | None:
    for pid in children(unit_pid):
        argv = stub_argv(pid)
        if argv and "tandem.transfer.proxy" in argv:
            return pid
    return None


@pytest.mark.slow
def test_unit_runs_the_proxy_and_restarts_the_server_when_it_dies(tmp_path: Path) -> None:
    """`tandem-unit --proxy`: the sidecar runs beside the server; SIGKILLed, it is started again and
    the server restarted (P and D must register with the new proxy), which then serves; SIGTERM to the
    supervisor stops both. (This CPU unit moves KV over host_shm: what is tested is the supervision.)"""
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path,
        extra_args=("--exit-timeout-secs=3",),
        launcher=(str(unit_bin), "--proxy", "--stop-timeout", "15", "--"),
    )
    shutil.rmtree(proc.repo / "tts_mono")
    proc.start()
    try:
        assert proc.proc is not None
        sup = proc.proc.pid
        proxy, server = _proxy_pid(sup), _server_pid(sup)
        assert proxy is not None
        os.kill(proxy, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new_proxy = _proxy_pid(sup)
            with contextlib.suppress(AssertionError):
                if new_proxy not in (None, proxy) and _server_pid(sup) != server:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"proxy or server not restarted:\n{proc.log_tail()}")
        r = None
        while time.monotonic() < deadline + 60:
            try:  # the new server may still be starting: no gRPC service, or models not ready yet
                r = run(proc.url, "tts", prompt(20, seed=9), timeout_s=20, MAX_TOKENS=5, TEMPERATURE=0.0)
            except InferenceServerException:
                r = None
            if r is not None and r.error is None:
                break
            time.sleep(0.5)
        assert r is not None and r.error is None and r.rows.shape == (5, TINY_W), proc.log_tail()
        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: tandem-proxy exited with status -9: starting a new one" in log, proc.log_tail()
        assert "restarting tritonserver (1 in the last minute): the IPC proxy was restarted" in log
        os.kill(sup, signal.SIGTERM)
        proc.proc.wait(30)
        gone = time.monotonic() + 10
        while process_state(new_proxy) not in ("", "Z") and time.monotonic() < gone:
            time.sleep(0.1)
        assert process_state(new_proxy) in ("", "Z"), "the proxy outlived its supervisor"
    finally:
        proc.stop()
