"""`tandem-unit` under a real tritonserver: engine deaths are the stubs' business, the server its own.

A P worker SIGKILLed under `tandem-unit`: P's stub starts a new worker (a new instance id) while the
server, its stubs and a stream already decoding on D live on; the supervisor only logs what
`tandem_engine_up` says (tandem.serving.health) and reloads nothing. An engine that stays down past
`--engine-down-grace` makes it restart the server. SIGTERM to the supervisor stops the server with its
status.
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

from tandem.gateway.client import TTSClient
from tandem.serving.repository import get_parameter
from tandem.serving.supervisor import http_base, option_values, with_explicit_control
from tests.support.faults import Background, children, find_stub, find_worker, process_state, stub_argv
from tests.support.helpers import TINY_W, decode, handoff, metric_value, metrics_text, prompt, run
from tests.support.server import TritonProcess

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
def test_unit_leaves_a_killed_p_to_its_stub(tmp_path: Path) -> None:
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path,
        extra_args=("--exit-timeout-secs=3",),
        launcher=(str(unit_bin), "--poll-interval", "0.2", "--stop-timeout", "15", "--"),
    )
    shutil.rmtree(proc.repo / "tts_mono")  # not used here; saves a start
    proc.start()
    try:
        assert proc.proc is not None
        server = _server_pid(proc.proc.pid)
        url = proc.url
        r = run(url, "tts", prompt(40), MAX_TOKENS=10, TEMPERATURE=0.0)
        assert r.error is None and r.rows.shape == (10, TINY_W), r.error
        before = _instance(url)
        old_stub = find_stub(server, "prefill")
        old_worker = find_worker(server, "prefill")
        assert old_stub is not None and old_worker is not None
        assert " ".join(stub_argv(old_worker)).startswith("tandem-engine prefill prefill_0_0 ")

        # A long stream whose KV has reached D (verified) before P dies: D keeps decoding it. The
        # baseline waits out the metrics' relay (a worker's counters arrive with its next heartbeat).
        verified = -1.0
        while verified != _verified(proc.metrics_url):
            verified = _verified(proc.metrics_url)
            time.sleep(0.5)
        long = Background(lambda: _long_stream(url))
        deadline = time.monotonic() + 20
        while _verified(proc.metrics_url) <= verified:
            assert time.monotonic() < deadline, "the long stream's KV never reached D"
            time.sleep(0.05)

        os.kill(old_worker, signal.SIGKILL)
        killed = time.monotonic()
        dead = run(url, "tts", prompt(20, seed=1), timeout_s=10, MAX_TOKENS=3, TEMPERATURE=0.0)
        assert dead.error is None or "[UNAVAILABLE] prefill: engine" in dead.error, dead.error

        back = None
        while time.monotonic() - killed < 60:
            r = run(url, "tts", prompt(20, seed=2), timeout_s=20, MAX_TOKENS=5, TEMPERATURE=0.0)
            if r.error is None:
                back = time.monotonic() - killed
                assert r.rows.shape == (5, TINY_W)
                break
            assert "[UNAVAILABLE] prefill: engine" in r.error, r.error
            time.sleep(0.2)
        assert back is not None, f"no tts request served within 60 s of P's death:\n{proc.log_tail()}"
        assert find_stub(server, "prefill") == old_stub, "P's stub died with its worker"
        new_worker = find_worker(server, "prefill")
        assert new_worker not in (None, old_worker)
        assert _server_pid(proc.proc.pid) == server, "the whole server was restarted, not just P"
        assert _instance(url) != before, "D decoded for the dead instance id"
        assert (
            metric_value(metrics_text(proc.metrics_url), "tandem_engine_restarts_total", model="prefill") == 1
        )

        survivor = long.join(60)
        assert survivor.error is None, survivor.error
        assert survivor.rows.shape == (LONG_ROWS, TINY_W)

        deadline = time.monotonic() + 5
        log = ""
        while time.monotonic() < deadline:
            log = proc.log_path.read_text(errors="replace")
            if "tandem-unit: prefill prefill_0_0: engine up again" in log:
                break
            time.sleep(0.2)
        assert "tandem-unit: prefill prefill_0_0: engine down (tandem_engine_up 0)" in log, proc.log_tail()
        assert "tandem-unit: prefill prefill_0_0: engine up again" in log, proc.log_tail()
        assert f"engine worker pid {old_worker} exited with status -9" in log, proc.log_tail()
        assert "restarting tritonserver" not in log
        print(f"\nP back {back:.1f} s after SIGKILL of its worker")

        os.kill(proc.proc.pid, signal.SIGTERM)
        status = proc.proc.wait(30)
        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: SIGTERM: forwarding it to tritonserver" in log
        assert f"tandem-unit: tritonserver exited with status {status}\n" in log, proc.log_tail()
        gone = time.monotonic() + 10
        while process_state(new_worker) not in ("", "Z") and time.monotonic() < gone:
            time.sleep(0.1)
        assert process_state(new_worker) in ("", "Z"), "an engine worker outlived its server"
    finally:
        proc.stop()


@pytest.mark.slow
def test_unit_restarts_the_server_when_an_engine_stays_down(tmp_path: Path) -> None:
    """D's worker stopped (SIGSTOP) past its stall bound and then past `--engine-down-grace`: its stub
    reports it down and cannot restart a worker that is alive, so the supervisor restarts the server,
    which serves again."""
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path,
        {"decode": {"tandem.worker.stall_timeout_s": "1"}},
        extra_args=("--exit-timeout-secs=3",),
        launcher=(
            str(unit_bin),
            "--poll-interval",
            "0.2",
            "--engine-down-grace",
            "3",
            "--stop-timeout",
            "10",
            "--",
        ),
    )
    shutil.rmtree(proc.repo / "tts_mono")
    proc.start()
    try:
        assert proc.proc is not None
        server = _server_pid(proc.proc.pid)
        worker = find_worker(server, "decode")
        assert worker is not None
        os.kill(worker, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        new_server = server
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):
                new_server = _server_pid(proc.proc.pid)
            if new_server != server:
                break
            time.sleep(0.2)
        assert new_server != server, f"the server was not restarted:\n{proc.log_tail()}"
        r = None
        while time.monotonic() < deadline + 60:
            try:
                r = run(proc.url, "tts", prompt(20, seed=3), timeout_s=20, MAX_TOKENS=5, TEMPERATURE=0.0)
            except InferenceServerException:
                r = None
            if r is not None and r.error is None:
                break
            time.sleep(0.5)
        assert r is not None and r.error is None and r.rows.shape == (5, TINY_W), proc.log_tail()
        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: decode decode_0_0: engine down" in log, proc.log_tail()
        assert "restarting tritonserver (1 in the last minute): engines down for" in log, proc.log_tail()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
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
