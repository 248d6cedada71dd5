"""The control APIs are locked, through the real server started the way `make serve` starts it
(tandem-unit -> the launcher -> tritonserver, explicit model control).

Each locked API (serving/api_key.py: model-repository, shared-memory, logging, trace, statistics) is
refused over HTTP (403) and gRPC (UNAVAILABLE) without the key and with a wrong one, and served with
the unit's key; health, metadata, model config and inference stay open; the key is in no log line.
`make serve` itself starts locked and on loopback only. Forged and replayed handoffs are refused in
test_tts_faults.py (docs/security.md lists every test of the threat model).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tandem.serving import process_tree
from tandem.serving.api_key import GRPC_HEADER, HEADER, resolve
from tandem.serving.launcher import cpu_machine
from tests.support.helpers import decode, handoff, prompt, run
from tests.support.server import REPO, TritonProcess, free_port

HTTP_REFUSED = f"This API is restricted, expecting header '{HEADER}'"
GRPC_REFUSED = f"This protocol is restricted, expecting header '{GRPC_HEADER}'"
WRONG = "0" * 64


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    unit_bin = Path(sys.executable).parent / "tandem-unit"
    proc = TritonProcess(tmp_path_factory.mktemp("security"), launcher=(str(unit_bin), "--")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def key(unit: TritonProcess) -> str:
    k = unit.api_lock().key
    assert k is not None
    return k


def http(
    unit: TritonProcess, method: str, path: str, body: Any = None, key: str | None = None
) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{unit.http_port}{path}",
        method=method,
        data=data,
        headers={HEADER: key} if key is not None else {},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def grpc(
    unit: TritonProcess, call: Callable[[grpcclient.InferenceServerClient, Any], Any], key: str | None
) -> Any:
    """`call(client, headers)`'s result, or the InferenceServerException it raised."""
    client = grpcclient.InferenceServerClient(unit.url)
    try:
        return call(client, {GRPC_HEADER: key} if key is not None else None)
    except InferenceServerException as exc:
        return exc
    finally:
        client.close()


def assert_http_refused(unit: TritonProcess, method: str, path: str, body: Any = None) -> None:
    for key in (None, WRONG):
        status, text = http(unit, method, path, body, key)
        assert status == 403 and HTTP_REFUSED in text, (method, path, key, status, text)


def assert_grpc_refused(unit: TritonProcess, call: Callable[..., Any]) -> None:
    for key in (None, WRONG):
        err = grpc(unit, call, key)
        assert isinstance(err, InferenceServerException), (key, err)
        assert err.status() == "StatusCode.UNAVAILABLE" and GRPC_REFUSED in str(err), err


def model_ready(unit: TritonProcess, model: str) -> bool:
    return bool(grpc(unit, lambda c, h: c.is_model_ready(model), None))


def wait_ready(unit: TritonProcess, model: str, ready: bool, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while model_ready(unit, model) != ready:
        assert time.monotonic() < deadline, f"{model} ready={not ready} after {timeout_s} s"
        time.sleep(0.2)


def wait_server_ready(unit: TritonProcess, timeout_s: float = 60.0) -> None:
    """The server ready again after a model came back: `tandem-unit` holds `/v2/health/ready` false
    while a speech model is missing or its engine is starting, and clears that once every speech
    stub and engine has been well for 1 s (docs/failure-semantics.md), a moment after the model
    itself reads ready."""
    deadline = time.monotonic() + timeout_s
    while http(unit, "GET", "/v2/health/ready")[0] != 200:
        assert time.monotonic() < deadline, f"the server not ready {timeout_s} s after its models"
        time.sleep(0.2)


# (API, method, path, body): calls that change nothing the other tests see
HTTP_CALLS = [
    ("model-repository", "POST", "/v2/repository/index", {}),
    ("shared-memory", "GET", "/v2/systemsharedmemory/status", None),
    ("logging", "GET", "/v2/logging", None),
    ("logging", "POST", "/v2/logging", {"log_verbose_level": 0}),
    ("trace", "GET", "/v2/trace/setting", None),
    ("trace", "POST", "/v2/trace/setting", {"trace_rate": "1000"}),
    ("statistics", "GET", "/v2/models/stats", None),
    ("statistics", "GET", "/v2/models/tts_mono/stats", None),
]

GRPC_CALLS: list[tuple[str, str, Callable[[grpcclient.InferenceServerClient, Any], Any]]] = [
    ("model-repository", "index", lambda c, h: c.get_model_repository_index(headers=h)),
    ("shared-memory", "status", lambda c, h: c.get_system_shared_memory_status(headers=h)),
    ("logging", "get", lambda c, h: c.get_log_settings(headers=h)),
    ("logging", "update", lambda c, h: c.update_log_settings({"log_verbose_level": 0}, headers=h)),
    ("trace", "get", lambda c, h: c.get_trace_settings(headers=h)),
    ("trace", "update", lambda c, h: c.update_trace_settings(settings={"trace_rate": "1000"}, headers=h)),
    ("statistics", "all", lambda c, h: c.get_inference_statistics(headers=h)),
    ("statistics", "tts_mono", lambda c, h: c.get_inference_statistics("tts_mono", headers=h)),
]


@pytest.mark.parametrize(
    ("api", "method", "path", "body"), HTTP_CALLS, ids=[f"{c[0]}-{c[1]}" for c in HTTP_CALLS]
)
def test_http_api_is_locked(
    unit: TritonProcess, key: str, api: str, method: str, path: str, body: Any
) -> None:
    assert_http_refused(unit, method, path, body)
    status, text = http(unit, method, path, body, key)
    assert status == 200, (api, status, text)


@pytest.mark.parametrize(("api", "what", "call"), GRPC_CALLS, ids=[f"{c[0]}-{c[1]}" for c in GRPC_CALLS])
def test_grpc_protocol_is_locked(unit: TritonProcess, key: str, api: str, what: str, call: Callable) -> None:
    assert_grpc_refused(unit, call)
    result = grpc(unit, call, key)
    assert not isinstance(result, InferenceServerException), (api, what, result)


def test_http_unload_and_load_need_the_key(unit: TritonProcess, key: str) -> None:
    """Found once: an unauthenticated unload took `tts_mono` down. Now only the key does."""
    unload, load = "/v2/repository/models/tts_mono/unload", "/v2/repository/models/tts_mono/load"
    assert_http_refused(unit, "POST", unload, {})
    assert model_ready(unit, "tts_mono")
    assert http(unit, "POST", unload, {}, key)[0] == 200
    wait_ready(unit, "tts_mono", False)
    assert_http_refused(unit, "POST", load, {})
    assert not model_ready(unit, "tts_mono")
    assert http(unit, "POST", load, {}, key)[0] == 200
    wait_ready(unit, "tts_mono", True)
    assert run(unit.url, "tts_mono", prompt(20), MAX_TOKENS=4).error is None
    wait_server_ready(unit)


def test_grpc_unload_and_load_need_the_key(unit: TritonProcess, key: str) -> None:
    assert_grpc_refused(unit, lambda c, h: c.unload_model("tts_mono", headers=h))
    assert model_ready(unit, "tts_mono")
    assert not isinstance(grpc(unit, lambda c, h: c.unload_model("tts_mono", headers=h), key), Exception)
    wait_ready(unit, "tts_mono", False)
    assert_grpc_refused(unit, lambda c, h: c.load_model("tts_mono", headers=h))
    assert not model_ready(unit, "tts_mono")
    assert not isinstance(grpc(unit, lambda c, h: c.load_model("tts_mono", headers=h), key), Exception)
    wait_ready(unit, "tts_mono", True)
    assert run(unit.url, "tts_mono", prompt(20), MAX_TOKENS=4).error is None
    wait_server_ready(unit)


@pytest.fixture
def shm() -> Iterator[shared_memory.SharedMemory]:
    region = shared_memory.SharedMemory(name=f"tandem-sec-{os.getpid()}", create=True, size=4096)
    yield region
    region.close()
    region.unlink()


def test_http_shared_memory_register_needs_the_key(
    unit: TritonProcess, key: str, shm: shared_memory.SharedMemory
) -> None:
    body = {"key": f"/{shm.name}", "offset": 0, "byte_size": 4096}
    register, unregister = (
        "/v2/systemsharedmemory/region/sec/register",
        "/v2/systemsharedmemory/region/sec/unregister",
    )
    assert_http_refused(unit, "POST", register, body)
    assert json.loads(http(unit, "GET", "/v2/systemsharedmemory/status", None, key)[1]) == []
    assert http(unit, "POST", register, body, key)[0] == 200
    status = json.loads(http(unit, "GET", "/v2/systemsharedmemory/status", None, key)[1])
    assert [r["name"] for r in status] == ["sec"]
    assert_http_refused(unit, "POST", unregister, {})
    assert http(unit, "POST", unregister, {}, key)[0] == 200


def test_grpc_shared_memory_register_needs_the_key(
    unit: TritonProcess, key: str, shm: shared_memory.SharedMemory
) -> None:
    def register(c: grpcclient.InferenceServerClient, h: Any) -> Any:
        return c.register_system_shared_memory("sec", f"/{shm.name}", 4096, headers=h)

    def status(c: grpcclient.InferenceServerClient, h: Any) -> Any:
        return c.get_system_shared_memory_status(headers=h, as_json=True)

    assert_grpc_refused(unit, register)
    assert grpc(unit, status, key) == {}
    assert not isinstance(grpc(unit, register, key), Exception)
    assert list(grpc(unit, status, key)["regions"]) == ["sec"]
    assert_grpc_refused(unit, lambda c, h: c.unregister_system_shared_memory("sec", headers=h))
    assert not isinstance(
        grpc(unit, lambda c, h: c.unregister_system_shared_memory("sec", headers=h), key), Exception
    )


def test_health_metadata_config_and_inference_stay_open(unit: TritonProcess) -> None:
    for path in ("/v2/health/ready", "/v2/health/live", "/v2", "/v2/models/tts", "/v2/models/tts/config"):
        assert http(unit, "GET", path)[0] == 200, path
    for call in (
        lambda c, h: c.is_server_ready(),
        lambda c, h: c.get_server_metadata(),
        lambda c, h: c.get_model_metadata("tts"),
        lambda c, h: c.get_model_config("tts"),
    ):
        assert not isinstance(grpc(unit, call, None), Exception)
    for model in ("tts", "tts_mono"):
        assert run(unit.url, model, prompt(20), MAX_TOKENS=4).error is None, model


def test_the_key_is_in_no_log(unit: TritonProcess, key: str) -> None:
    """tandem-unit logs the server's command line with the key redacted; Triton logs no option value."""
    text = unit.log_path.read_text(errors="replace")
    assert "started tritonserver" in text and "tandem-api-key=<api-key>" in text
    assert key not in text


@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("/tmp/elsewhere/p-prefill_0_0.sock", "is not in this unit's"),
        ("tcp://192.0.2.1:9", "only a path where D writes every byte"),
    ],
)
def test_a_handoff_that_points_d_elsewhere_is_refused(unit: TritonProcess, endpoint: str, says: str) -> None:
    """Any inference client can call `decode` with a HANDOFF of its own: D follows only endpoints of
    its own unit (a socket in its 0700 directory; a tcp:// one only in a ticket signed with the unit
    secret, on the tcp path), so a forged one makes D connect nowhere. Replays, unknown transfers and
    tampered fields are refused in test_tts_faults.py."""
    forged = json.loads(handoff(unit.url))
    forged["ticket"]["endpoint"] = endpoint
    _, err = decode(unit.url, json.dumps(forged))
    assert err is not None and says in err, err
    out, err = decode(unit.url, handoff(unit.url))  # D keeps serving
    assert err is None and sum(o["TOKENS"].shape[0] for o in out) == 8, err


def _outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), or None if it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
        except OSError:
            return None
        addr = str(s.getsockname()[0])
    return None if addr.startswith("127.") else addr


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["group", "make"])
def test_make_serve_starts_locked_on_loopback(tmp_path: Path, stop: str) -> None:
    """... and stops whole: SIGTERM to make's process group (Ctrl-C's way), or to make alone (a
    process manager's): the recipe's shell forwards it to tandem-unit and stops the gateway."""
    venv = Path(sys.executable).parent.parent
    ports = {
        "GRPC_PORT": free_port(),
        "HTTP_PORT": free_port(),
        "METRICS_PORT": free_port(),
        "GATEWAY_PORT": free_port(),
    }
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run_dir)}
    env.pop("TANDEM_API_LOCK", None)
    env.pop("TANDEM_API_KEY_FILE", None)
    log = tmp_path / "serve.log"
    argv = [
        "make",
        "-s",
        "-o",
        f"{venv}/.installed",
        "serve",
        f"VENV={venv}",
        *(f"{k}={v}" for k, v in ports.items()),
        f"STATE_DIR={tmp_path / 'state'}",
    ]
    with open(log, "wb") as out:
        make = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        ready = f"http://127.0.0.1:{ports['HTTP_PORT']}/v2/health/ready"
        deadline = time.monotonic() + 180
        while True:  # over HTTP: a gRPC channel made before the server listens backs off for long
            assert make.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "make serve not ready in 180 s"
            try:
                with urllib.request.urlopen(ready, timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # not listening yet, or 400 while models load
                pass
            time.sleep(0.5)
        key = resolve(["--model-repository", str(REPO / "model_repository")], env).key
        index = f"http://127.0.0.1:{ports['HTTP_PORT']}/v2/repository/index"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(index, method="POST", data=b"{}"), timeout=30)
        assert refused.value.code == 403
        req = urllib.request.Request(index, method="POST", data=b"{}", headers={HEADER: str(key)})
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        outward = _outward_address()
        if outward is not None:  # loopback only: the host's own network address is not served
            for port in ports.values():
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((outward, port), timeout=5).close()
        assert str(key) not in log.read_text(errors="replace")
        # one line says the unit and the gateway are ready, with the gateway's URL (cli/ready.py);
        # on a CPU machine one line says CPU mode and no CUDA/NVML error line shows (launcher)
        gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}/v1"
        while "tandem: ready:" not in log.read_text(errors="replace"):
            assert make.poll() is None and time.monotonic() < deadline + 120, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        assert f"tandem: ready: OpenAI speech API {gateway} " in text
        if cpu_machine():
            assert text.count("CPU mode (no NVIDIA device)") >= 1
            for noise in (
                "CudaDriverHelper",
                "CUDA driver version is insufficient",
                "Failed to initialize NVML",
            ):
                assert noise not in text, noise
    finally:
        # make's whole process group (make, its shell, tandem-gateway, tandem-unit), and afterwards
        # whatever was below it: tandem-unit's server runs in a session of its own.
        tree = process_tree.descendants(make.pid)
        if stop == "group":
            os.killpg(make.pid, signal.SIGTERM)
        else:
            os.kill(make.pid, signal.SIGTERM)
        make.wait(60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(process_tree.alive(p) for p in tree):
            time.sleep(0.5)
        left = process_tree.kill_all(tree)
        assert not left, (
            f"still running 60 s after make's SIGTERM: {[process_tree.argv(p)[:2] for p in left]}"
        )
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", ports["GRPC_PORT"]), timeout=1).close()
