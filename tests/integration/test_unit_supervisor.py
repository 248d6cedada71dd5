"""`tandem-unit` under a real tritonserver: engine deaths are the stubs' business, the rest its own.

A P worker SIGKILLed under `tandem-unit`: P's stub starts a new worker (a new instance id) while the
server, its stubs and a stream already decoding on D live on; the supervisor only logs what
`tandem_engine_up` says (tandem.serving.health) and reloads nothing. An engine that stays down past
`--engine-down-grace` makes it restart the server. SIGTERM to the supervisor (a stream in flight)
stops the unit within 15 s with status 0 and nothing of its tree left. A dead *stub* (each of P, D,
mono, vocoder, frontend) has its model reloaded; a hung server is killed whole and restarted; a
SIGKILLed server's stubs and workers exit by themselves (the rows at the end, with their figures).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from tandem.gateway.app import Gateway, GatewaySettings
from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.client import TTSClient
from tandem.gateway.stream import GatewayError, StreamRequest, new_stream_id, prompt_inputs
from tandem.gateway.voice_client import VoiceClient, VoiceError
from tandem.serving import process_tree
from tandem.serving.health import parse_health
from tandem.serving.repository import get_parameter
from tandem.serving.supervisor import http_base, option_values, with_explicit_control
from tests.support.faults import Background, children, find_stub, find_worker, process_state, stub_argv
from tests.support.helpers import (
    TINY_W,
    decode,
    handoff,
    metric_value,
    metrics_text,
    prompt,
    run,
    wait_metric,
)
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


def _gateway_stream(url: str, metrics_url: str, model: str) -> tuple[str | None, float]:
    """A long stream through the gateway's own streaming path (SSE): (its error or None, when it
    ended). The gateway ends a silent stream whose path has a dead stub (by the unit's metrics)."""

    async def main() -> tuple[str | None, float]:
        gw = Gateway(GatewaySettings(url, metrics_url))
        await gw.start()
        try:
            while gw.models is None:
                await asyncio.sleep(0.05)
            inputs = prompt_inputs(prompt(30, seed=6), MAX_TOKENS=LONG_ROWS, TEMPERATURE=0.0)
            framer = Framer(AudioFormat.PCM, StreamFormat.SSE, 22050)
            try:
                resp = await gw.respond(
                    StreamRequest(model, inputs, new_stream_id()), framer, time.monotonic()
                )
            except GatewayError as exc:
                return str(exc.error), time.monotonic()
            error = None
            async for chunk in resp.body_iterator:
                text = chunk if isinstance(chunk, str) else bytes(chunk).decode()
                for event in text.split("\n\n"):
                    if event.startswith("data: ") and (e := json.loads(event[6:]))["type"] == "error":
                        error = e["error"]["message"]
            return error, time.monotonic()
        finally:
            await gw.stop()

    return asyncio.run(main())


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
    proc = TritonProcess(tmp_path, launcher=(str(unit_bin), "--poll-interval", "0.2", "--"))
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

        # SIGTERM with a stream in flight: drained up to --exit-timeout-secs (8 s by default), the
        # tree killed at --stop-timeout (12 s), exit 0 within 15 s, nothing of the tree left.
        tree = process_tree.descendants(server)
        flight = Background(lambda: _long_stream(url))
        time.sleep(1.0)
        os.kill(proc.proc.pid, signal.SIGTERM)
        signalled = time.monotonic()
        status = proc.proc.wait(30)
        stop_s = time.monotonic() - signalled
        log = proc.log_path.read_text(errors="replace")
        assert "tandem-unit: SIGTERM: forwarding it to tritonserver" in log
        assert status == 0 and "; stopped as asked" in log, proc.log_tail()
        assert stop_s <= 15, f"the unit took {stop_s:.1f} s to stop"
        assert not [p for p in tree if process_tree.alive(p)], "part of the server's tree outlived it"
        with contextlib.suppress(TimeoutError, InferenceServerException):
            flight.join(60)  # cut off by the stop: how is the drain's business, not this test's
        print(f"SIGTERM with a stream in flight: the unit exited 0 {stop_s:.1f} s after it")
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


@pytest.mark.slow
def test_voices_is_its_own_failure_domain(tmp_path: Path) -> None:
    """The voices worker killed three times within a minute, then stopped (SIGSTOP) past its stall
    bound and `--engine-down-grace`: its stub says once that it crash-loops; the unit reloads the
    voices model (never the server) and registration serves again; speech is never unready by
    Triton, `tandem-health`'s reading or the gateway, and `tts` serves throughout."""
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(
        tmp_path,
        {"voices": {"tandem.worker.stall_timeout_s": "1"}},
        # longer than a voices worker's restart (its stub's business), shorter than the test
        launcher=(str(unit_bin), "--poll-interval", "0.2", "--engine-down-grace", "20", "--"),
    )
    shutil.rmtree(proc.repo / "tts_mono")  # not used here; saves a start
    proc.start()
    url, metrics = proc.url, proc.metrics_url
    http = f"http://127.0.0.1:{proc.http_port}"
    speech_unready: list[str] = []
    stop = False

    def watch_speech() -> None:
        while not stop:
            health = parse_health(metrics_text(metrics))
            if not _triton_ready(http) or not health.ready:
                speech_unready.append(f"triton {_triton_ready(http)}, reasons {health.reasons}")
            time.sleep(0.1)

    watcher = Background(watch_speech)
    try:
        assert proc.proc is not None
        server = _server_pid(proc.proc.pid)
        for _ in range(3):  # a crash loop: each new worker killed as soon as it serves
            deadline = time.monotonic() + 60
            while (worker := find_worker(server, "voices")) is None or _engine_up(metrics, "voices") != 1.0:
                assert time.monotonic() < deadline, proc.log_tail()
                time.sleep(0.1)
            os.kill(worker, signal.SIGKILL)
            time.sleep(0.3)
        r = run(url, "tts", prompt(20, seed=11), timeout_s=30, MAX_TOKENS=4, TEMPERATURE=0.0)
        assert r.error is None, r.error
        deadline = time.monotonic() + 60
        while (worker := find_worker(server, "voices")) is None or _engine_up(metrics, "voices") != 1.0:
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.1)
        stub = find_stub(server, "voices")
        os.kill(worker, signal.SIGSTOP)  # stalled: its stub cannot replace a live worker
        stopped = time.monotonic()
        log = ""
        while "reloading the voices model (1 in a row), not the server" not in log:
            assert time.monotonic() - stopped < 60, proc.log_tail()
            log = proc.log_path.read_text(errors="replace")
            time.sleep(0.2)
        deadline = time.monotonic() + 90
        while True:
            try:
                with VoiceClient(url) as vc:
                    vc.list(timeout_s=10)
                if find_stub(server, "voices") not in (None, stub):
                    break
            except (VoiceError, InferenceServerException):
                pass
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.3)
        back_s = time.monotonic() - stopped
        r = run(url, "tts", prompt(20, seed=12), timeout_s=30, MAX_TOKENS=4, TEMPERATURE=0.0)
        assert r.error is None, r.error
        stop = True
        watcher.join(10)
        log = proc.log_path.read_text(errors="replace")
        assert log.count("voices_0_0: engine worker crash-looping") == 1, proc.log_tail()
        assert "restarting tritonserver" not in log and _server_pid(proc.proc.pid) == server
        assert "server marked not ready" not in log
        assert not speech_unready, speech_unready[:3]
        assert _gateway_health(url, metrics, models=("tts",))[0] == 200
        print(f"\nvoices stalled: model reloaded, registration served again {back_s:.1f} s after the stop")
    finally:
        stop = True
        with contextlib.suppress(ProcessLookupError, UnboundLocalError):
            os.kill(worker, signal.SIGCONT)
        proc.stop()


def _proxy_pid(unit_pid: int) -> int | None:
    for pid in children(unit_pid):
        argv = stub_argv(pid)
        if argv and "tandem.transfer.paths.proxy_sidecar" in argv:
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


# ---- the unit's own fault rows: stub death of each model, a hung server, a killed one -------------
#
# One supervised unit serves every row below, in order: each stub killed in turn (its model reloaded
# by the supervisor), then the server stopped (SIGSTOP: killed whole and restarted), then the
# supervisor stopped and the server SIGKILLed (its stubs and workers must exit by themselves), then
# the supervisor resumed (a new server) and SIGKILLed itself (nothing of the unit may outlive it). The
# repository is one that was started before: its models' byte code is compiled before the first start,
# so no start or reload writes into it, and Triton's view of its files never changes (a plain `load`
# of a model would then start nothing). Figures are printed (-s) and summed up by the last test.

STUB_ROWS = ("prefill", "decode", "tts_mono", "vocoder", "frontend", "voices")
ENTRY = {
    "tts_mono": "tts_mono",
    "voices": "voices",
}  # the model a client calls to reach each one (else `tts`)
SPEECH = ("tts", "tts_mono")
FIGURES: dict[str, dict[str, float]] = {}
IN_FLIGHT_S = 25.0  # the in-flight stream's client bound (a stream on a dead stub gets no answer)
BACK_S = 30.0  # a dead stub's model serves again within this (docs/failure-semantics.md)
NOT_READY_S = 5.0  # speech's readiness says false within this of a speech stub's death


def _repository_times(repo: Path) -> dict[str, int]:
    """Every path's mtime under the repository (what Triton compares to decide a model changed)."""
    return {str(p): p.stat().st_mtime_ns for p in [repo, *repo.rglob("*")]}


def _region(pid: int) -> str:
    """A stub's python-backend /dev/shm region: its argv[2]."""
    argv = stub_argv(pid)
    assert len(argv) > 2, argv
    return argv[2]


def _triton_ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http}/v2/health/ready", timeout=3) as resp:
            return resp.status == 200
    except urllib.error.HTTPError:
        return False  # Triton answers 400 for "not ready"


def _engine_up(metrics_url: str, model: str) -> float | None:
    """The raw `tandem_engine_up` of `model`'s instance 0 (no heartbeat judgement), None if absent."""
    try:
        return metric_value(
            metrics_text(metrics_url), "tandem_engine_up", model=model, model_instance=f"{model}_0_0"
        )
    except KeyError:
        return None


def _gateway_health(
    url: str, metrics_url: str, voices: bool = False, models: tuple[str, ...] = SPEECH
) -> tuple[int, dict]:
    async def main() -> tuple[int, dict]:
        gw = Gateway(GatewaySettings(url, metrics_url, models=models))
        await gw.start()
        try:
            while gw.models is None:
                await asyncio.sleep(0.05)
            resp = await gw.health(voices=voices)
            return resp.status_code, json.loads(bytes(resp.body))
        finally:
            await gw.stop()

    return asyncio.run(main())


class SupervisedUnit:
    def __init__(self, proc: TritonProcess, load_s: float, times: dict[str, int]) -> None:
        self.proc = proc
        self.load_s = load_s  # this run's own load time: the baseline for the restart bounds
        self.times = times  # the repository's mtimes once it served

    @property
    def sup(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.proc.http_port}"

    def server(self) -> int:
        return _server_pid(self.sup)

    def log(self) -> str:
        return self.proc.log_path.read_text(errors="replace")

    def wait_log(self, text: str, since: int, timeout_s: float) -> float:
        """Seconds until `text` appears in the log after byte `since` (AssertionError at timeout)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if text in self.log()[since:]:
                return time.monotonic() - start
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not logged within {timeout_s} s:\n{self.proc.log_tail()}")

    def prefix(self) -> str:
        line = next(x for x in self.log().splitlines() if "shm-region-prefix-name=" in x)
        return line.split("shm-region-prefix-name=")[1].split()[0]

    def serves(self, model: str, seed: int) -> str | None:
        """One request through `model` (`voices`: a list): None when it succeeds, else its error."""
        try:
            if model == "voices":
                with VoiceClient(self.proc.url) as vc:
                    vc.list(timeout_s=10)
                return None
            r = run(self.proc.url, model, prompt(20, seed=seed), timeout_s=20, MAX_TOKENS=4, TEMPERATURE=0.0)
            return r.error
        except (InferenceServerException, TimeoutError, VoiceError) as exc:
            return str(exc)

    def serve(self, model: str, seed: int, timeout_s: float) -> float:
        """Seconds until a request through `model` succeeds."""
        start = time.monotonic()
        last = None
        while time.monotonic() - start < timeout_s:
            last = self.serves(model, seed)
            if last is None:
                return time.monotonic() - start
            time.sleep(0.2)
        raise AssertionError(
            f"{model} not served within {timeout_s} s (last: {last}):\n{self.proc.log_tail()}"
        )


@pytest.fixture(scope="module")
def supervised(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisedUnit]:
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    opts = (
        "--poll-interval",
        "0.2",
        "--probe-interval",
        "1",
        "--probe-timeout",
        "2",
        "--probe-failures",
        "3",
    )
    proc = TritonProcess(tmp_path_factory.mktemp("supervised"), launcher=(str(unit_bin), *opts, "--"))
    # A repository started before: its model code's byte code is there, so no start writes into it.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(proc.repo)], check=True)
    started = time.monotonic()
    proc.start()
    try:
        yield SupervisedUnit(proc, time.monotonic() - started, _repository_times(proc.repo))
    finally:
        proc.stop()


@pytest.mark.slow
def test_regions_are_private_to_the_servers_user(supervised: SupervisedUnit) -> None:
    """Every /dev/shm region of the unit (request tensors, text included, pass through them) is 0600;
    another uid cannot open one (checked as root from a forked child switched to uid 65534)."""
    regions = sorted(Path("/dev/shm").glob(f"{supervised.prefix()}*"))
    assert regions, "no region of the unit's prefix"
    modes = {r.name: oct(r.stat().st_mode & 0o777) for r in regions}
    assert set(modes.values()) == {"0o600"}, modes
    if os.geteuid() != 0:
        pytest.skip("another uid's view needs root (a setuid child)")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: uid/gid 65534, counts the regions it can open
        code = 255
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = 0
            for region in regions:
                try:
                    os.close(os.open(region, os.O_RDONLY))
                    code += 1
                except PermissionError:
                    pass
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"uid 65534 opened regions of {len(regions)}"


@pytest.mark.slow
@pytest.mark.parametrize("model", STUB_ROWS)
def test_stub_death_is_seen_and_the_model_reloaded(supervised: SupervisedUnit, model: str) -> None:
    """kill -9 of the model's stub, on a repository whose files Triton has seen unchanged since it
    loaded them: the supervisor sees it within a poll, removes its /dev/shm region and reloads the
    model with a new stub, which serves again within 30 s; the same server, every other model's stub
    untouched. While a speech model is down, Triton's `/v2/health/ready` says not ready within 5 s and
    `tandem_engine_up` for it reads 0 (published by its new stub, not the dead one's last 1); both come
    back with it. `voices` is its own failure domain: speech stays ready and serving throughout.
    `tandem_model_reloads` counts 1 (once the new stub served); a stream in flight on it ends."""
    entry = ENTRY.get(model, "tts")
    url, metrics = supervised.proc.url, supervised.proc.metrics_url
    speech = model != "voices"
    supervised.serve(entry, seed=1, timeout_s=120)
    assert parse_health(metrics_text(metrics)).ready and _triton_ready(supervised.http)
    assert _repository_times(supervised.proc.repo) == supervised.times, (
        "a start or reload wrote into the repository"
    )
    server = supervised.server()
    stubs = process_tree.stub_details(server, [str(supervised.proc.repo)])
    stub = find_stub(server, model)
    assert stub is not None
    region = _region(stub)
    others = {pid: s.model for pid, s in stubs.items() if s.model != model}
    since = len(supervised.log())

    def long_stream() -> tuple[str | None, float]:
        """(how the stream ended, when): its error, a client timeout, or None (it finished)."""
        c = TTSClient(url, entry)
        try:
            r = c.run(prompt(30, seed=5), timeout_s=IN_FLIGHT_S, MAX_TOKENS=LONG_ROWS, TEMPERATURE=0.0)
        except (TimeoutError, InferenceServerException) as exc:
            ended = time.monotonic()
            c.close(cancel=True)  # a plain close waits for a response that never comes
            return f"{type(exc).__name__}: {exc}", ended
        c.close()
        return r.error, time.monotonic()

    flight = Background(long_stream) if speech else None
    via_gateway = Background(lambda: _gateway_stream(url, metrics, entry)) if speech else None
    time.sleep(1.0)
    os.kill(stub, signal.SIGKILL)
    killed = time.monotonic()
    detected = supervised.wait_log(f"tandem-unit: {model}: its stub (pid {stub}) died; reloading", since, 10)
    not_ready = zero = None
    triton_ready_during = True
    while time.monotonic() - killed < NOT_READY_S + 3 and (zero is None or (speech and not_ready is None)):
        if not _triton_ready(supervised.http):
            triton_ready_during = False
            not_ready = not_ready or time.monotonic() - killed
        if zero is None and _engine_up(metrics, model) == 0.0:
            zero = time.monotonic() - killed
        time.sleep(0.05)
    assert zero is not None and zero <= NOT_READY_S, (
        f"tandem_engine_up of {model} never read 0:\n{supervised.proc.log_tail()}"
    )
    if speech:
        assert not_ready is not None and not_ready <= NOT_READY_S, (
            f"Triton stayed ready with {model} down:\n{supervised.proc.log_tail()}"
        )
        assert _gateway_health(url, metrics)[0] == 503
        other = "tts" if entry == "tts_mono" else "tts_mono"
        supervised.serve(other, seed=3, timeout_s=20)  # the other entry does not need the dead stub
    else:  # voices down: speech is not touched
        for name in SPEECH:
            assert supervised.serves(name, seed=3) is None
        status, body = _gateway_health(url, metrics)
        assert status == 200, body
        assert _gateway_health(url, metrics, voices=True)[0] == 503
    supervised.serve(entry, seed=2, timeout_s=BACK_S + 30)
    back = time.monotonic() - killed
    assert not Path(f"/dev/shm/{region}").exists(), "the dead stub's region is left"
    ready_again = None
    deadline = time.monotonic() + 15
    while ready_again is None and time.monotonic() < deadline:
        health = parse_health(metrics_text(metrics))
        if _triton_ready(supervised.http) and health.ready and (speech or health.voices_ready):
            ready_again = time.monotonic() - killed
        time.sleep(0.1)
    assert ready_again is not None, parse_health(metrics_text(metrics)).reasons
    if not speech:
        triton_ready_during = triton_ready_during and _triton_ready(supervised.http)
        assert triton_ready_during, "voices' death made Triton not ready"
    assert _engine_up(metrics, model) == 1.0
    assert supervised.server() == server, "the server was restarted, not the model reloaded"
    now = process_tree.stub_details(server, [str(supervised.proc.repo)])
    assert {pid: s.model for pid, s in now.items() if s.model != model} == others, (
        "another model's stub changed"
    )
    # Triton 2.51 never waits for a dead stub: it stays a zombie of the server (no process, no
    # memory, one pid) until the server exits; nothing outside the server can reap it.
    assert process_state(stub) in ("", "Z"), "the dead stub still runs"
    # The unit counts the reload once the new stub serves and writes it to the unit's state file; the
    # stubs publish it on their next beat (1 s), which on a busy box can come after the checks above.
    supervised.wait_log(f"tandem-unit: {model}: reloaded in ", since, 10)
    wait_metric(metrics, "tandem_model_reloads", lambda v: v == 1, 10, model=model)
    flight_s = gateway_s = float("nan")
    err = gw_err = None
    if flight is not None and via_gateway is not None:
        err, ended_at = flight.join(120)
        flight_s = ended_at - killed
        gw_err, gw_ended_at = via_gateway.join(60)
        gateway_s = gw_ended_at - killed
        if model in ("decode", "tts_mono"):  # Triton never answers: the gateway sees the dead stub itself
            assert gw_err is not None and "the stream is lost" in gw_err and f"{model} " in gw_err, gw_err
            assert gateway_s <= 10.0, (gateway_s, gw_err)
        elif model == "vocoder":  # the next chunk's request reaches the dead stub: Triton's own error
            assert gw_err is not None and gateway_s <= 10.0, (gateway_s, gw_err)
        else:  # a stream past the front end and P finishes (or D, busy on a loaded box, refused it)
            assert gw_err is None or "[UNAVAILABLE] no capacity" in gw_err, gw_err
    assert _repository_times(supervised.proc.repo) == supervised.times
    FIGURES[f"stub {model}"] = {
        "detected_s": detected,
        "engine_up_0_s": zero,
        "not_ready_s": not_ready if speech else float("nan"),
        "served_again_s": back,
        "ready_again_s": ready_again,
        "in_flight_ended_s": flight_s,
        "gateway_stream_ended_s": gateway_s,
    }
    print(
        f"\nstub death {model}: seen {detected:.1f} s after kill -9, tandem_engine_up 0 at {zero:.1f} s, "
        f"Triton not ready at {not_ready} s, {entry} served again {back:.1f} s, ready again "
        f"{ready_again:.1f} s; the gRPC stream in flight ended {flight_s:.1f} s after the kill with {err!r}; "
        f"through the gateway {gateway_s:.1f} s with {gw_err!r}"
    )


@pytest.mark.slow
def test_hung_server_is_killed_whole_and_restarted(supervised: SupervisedUnit) -> None:
    """SIGSTOP of tritonserver: the supervisor's probes fail (1 s apart, 2 s timeout, 3 in a row),
    it kills the whole tree and starts the server again, which serves within 60 s + this run's load
    time."""
    server = supervised.server()
    tree = process_tree.descendants(server)
    assert len(tree) >= 5, tree
    since = len(supervised.log())
    os.kill(server, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        detected = supervised.wait_log(
            "restarting tritonserver (1 in the last minute): it did not answer", since, 60
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGCONT)
    gone = time.monotonic() + 10
    while any(process_tree.alive(p) for p in [server, *tree]) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not any(process_tree.alive(p) for p in [server, *tree]), "part of the hung server's tree lives on"
    supervised.serve("tts", seed=3, timeout_s=60 + 2 * supervised.load_s)
    served = time.monotonic() - stopped
    assert served <= 60 + 2 * supervised.load_s
    FIGURES["hung server"] = {"detected_s": detected, "served_again_s": served, "load_s": supervised.load_s}
    print(
        f"\nhung server: killed and restarted {detected:.1f} s after SIGSTOP, tts served again "
        f"{served:.1f} s after it (this run's first load took {supervised.load_s:.1f} s)"
    )


def _stream_until_it_ends(url: str, model: str, seed: int) -> tuple[str | None, float]:
    """A long stream through `model`: (how it ended, when): its error, a client timeout, or None."""
    c = TTSClient(url, model)
    try:
        r = c.run(prompt(30, seed=seed), timeout_s=IN_FLIGHT_S, MAX_TOKENS=LONG_ROWS, TEMPERATURE=0.0)
    except (TimeoutError, InferenceServerException) as exc:
        ended = time.monotonic()
        c.close(cancel=True)
        return f"{type(exc).__name__}: {exc}", ended
    ended = time.monotonic()
    with contextlib.suppress(Exception):
        c.close()
    return r.error, ended


@pytest.mark.slow
def test_an_aborted_server_is_restarted_and_its_clients_hear_at_once(supervised: SupervisedUnit) -> None:
    """SIGABRT of tritonserver with streams in flight (what Triton 2.51 does to itself when a stub
    that stalled under traffic resumes, server #8882): every client's stream ends with an error
    within 1 s of the server's exit (its connections break; how long Triton's own abort handler runs
    before the process ends, 0.2-2.2 s here by the box's load, is Triton's and bounded separately),
    the supervisor restarts the server, which serves again."""
    url, metrics = supervised.proc.url, supervised.proc.metrics_url
    supervised.serve("tts", seed=8, timeout_s=120)
    server = supervised.server()
    since = len(supervised.log())
    flights = {m: Background(lambda m=m: _stream_until_it_ends(url, m, 9)) for m in SPEECH}
    via_gateway = Background(lambda: _gateway_stream(url, metrics, "tts"))
    time.sleep(1.5)
    os.kill(server, signal.SIGABRT)
    aborted = time.monotonic()
    while process_tree.alive(server) and time.monotonic() - aborted < 10:
        time.sleep(0.01)
    exited = time.monotonic() - aborted
    assert exited < 10, "tritonserver still runs 10 s after its SIGABRT"
    ended = {m: b.join(60) for m, b in flights.items()}
    ended["gateway tts"] = via_gateway.join(60)
    told = {m: at - aborted for m, (_, at) in ended.items()}
    for m, (err, _) in ended.items():
        assert err is not None, f"{m}: the stream finished although its server aborted"
        assert told[m] - exited <= 1.0, (
            f"{m} heard {told[m]:.1f} s after the abort, {told[m] - exited:.1f} s after its exit: {err}"
        )
    detected = supervised.wait_log("in the last minute): it exited unexpectedly with status -6", since, 60)
    served = supervised.serve("tts", seed=10, timeout_s=60 + 2 * supervised.load_s)
    assert supervised.server() != server
    FIGURES["aborted server"] = {
        "server_exited_s": exited,
        "clients_told_s": max(told.values()),
        "restart_started_s": detected,
        "served_again_s": time.monotonic() - aborted,
    }
    print(
        f"\naborted server: exited {exited:.2f} s after SIGABRT, clients told "
        f"{', '.join(f'{m} {t:.2f} s' for m, t in told.items())} after the signal; restart began "
        f"{detected:.1f} s after it; tts served {served:.1f} s after that"
    )


@pytest.mark.slow
def test_a_killed_servers_tree_exits_by_itself_and_its_regions_go(supervised: SupervisedUnit) -> None:
    """With the supervisor stopped (SIGSTOP: it cannot clean up), SIGKILL of tritonserver: every
    stub and engine worker exits by itself within 45 s (stubs watch their server, workers their
    stub), and each stub's watcher removes its /dev/shm region. Then SIGCONT to the supervisor: it
    starts a new server, which serves."""
    supervised.serve("tts", seed=4, timeout_s=120)
    server = supervised.server()
    tree = process_tree.descendants(server)
    workers = [p for p in tree if " ".join(process_tree.argv(p)).startswith("tandem-engine ")]
    assert len(workers) >= 3, tree
    prefix = supervised.prefix()
    assert list(Path("/dev/shm").glob(f"{prefix}*"))
    since = len(supervised.log())
    os.kill(supervised.sup, signal.SIGSTOP)
    try:
        os.kill(server, signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 45 and (
            any(process_tree.alive(p) for p in tree) or list(Path("/dev/shm").glob(f"{prefix}*"))
        ):
            time.sleep(0.1)
        orphans_s = time.monotonic() - killed
        left = [(p, process_tree.argv(p)[:2]) for p in tree if process_tree.alive(p)]
        assert not left, f"alive 45 s after their server's SIGKILL: {left}"
        regions = sorted(r.name for r in Path("/dev/shm").glob(f"{prefix}*"))
        assert not regions, f"left by the dead server's stubs: {regions}"
    finally:
        os.kill(supervised.sup, signal.SIGCONT)
    supervised.wait_log("in the last minute): it exited unexpectedly with status -9", since, 30)
    served = supervised.serve("tts", seed=5, timeout_s=60 + 2 * supervised.load_s)
    FIGURES["killed server"] = {"tree_and_regions_gone_s": orphans_s, "served_again_s": served}
    print(
        f"\nkilled server: its {len(tree)} stubs and workers and their regions gone {orphans_s:.1f} s after "
        f"its SIGKILL; a new server served {served:.1f} s after the supervisor resumed"
    )


@pytest.mark.slow
def test_a_killed_supervisor_leaves_nothing_and_clients_hear_at_once(supervised: SupervisedUnit) -> None:
    """`kill -9` of tandem-unit itself, streams in flight on `tts` and `tts_mono` (gRPC) and through
    the gateway: the kernel SIGKILLs the server at once (PR_SET_PDEATHSIG), so every client's stream
    ends with an error within 2 s; within 10 s no tritonserver, stub or worker of the unit is alive
    and no /dev/shm region of its prefix is left (each stub's watcher removes its own)."""
    url, metrics = supervised.proc.url, supervised.proc.metrics_url
    supervised.serve("tts", seed=6, timeout_s=120)
    supervised.serve("tts_mono", seed=6, timeout_s=120)
    tree = process_tree.descendants(supervised.sup)
    assert any(" ".join(process_tree.argv(p)).startswith("tandem-engine ") for p in tree), tree
    prefix = supervised.prefix()
    assert list(Path("/dev/shm").glob(f"{prefix}*"))

    flights = {m: Background(lambda m=m: _stream_until_it_ends(url, m, 7)) for m in SPEECH}
    via_gateway = Background(lambda: _gateway_stream(url, metrics, "tts"))
    time.sleep(1.5)
    os.kill(supervised.sup, signal.SIGKILL)
    killed = time.monotonic()
    ended = {m: b.join(60) for m, b in flights.items()}
    ended["gateway tts"] = via_gateway.join(60)
    told = {m: at - killed for m, (_, at) in ended.items()}
    for m, (err, _) in ended.items():
        assert err is not None, f"{m}: the stream finished although its server was killed"
        assert told[m] <= 2.0, f"{m} heard {told[m]:.1f} s after the kill: {err}"
    while time.monotonic() - killed < 10 and (
        any(process_tree.alive(p) for p in tree) or list(Path("/dev/shm").glob(f"{prefix}*"))
    ):
        time.sleep(0.1)
    gone_s = time.monotonic() - killed
    left = [(p, process_tree.argv(p)[:2]) for p in tree if process_tree.alive(p)]
    assert not left, f"alive 10 s after tandem-unit's SIGKILL: {left}"
    regions = sorted(r.name for r in Path("/dev/shm").glob(f"{prefix}*"))
    assert not regions, f"left 10 s after tandem-unit's SIGKILL: {regions}"
    FIGURES["killed supervisor"] = {"clients_told_s": max(told.values()), "tree_and_regions_gone_s": gone_s}
    print(
        f"\nkilled supervisor: clients told {', '.join(f'{m} {t:.2f} s' for m, t in told.items())} after "
        f"kill -9 ({', '.join(f'{m}: {e!r}' for m, (e, _) in ended.items())}); its {len(tree)} processes and "
        f"regions gone {gone_s:.1f} s after it"
    )
    print("\nthe unit's fault rows (seconds):")
    for row, figures in FIGURES.items():
        print(f"  {row:18s} " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items()))
