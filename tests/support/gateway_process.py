"""`tandem-gateway` as its own process in front of a test's tritonserver, and the plain-HTTP helpers
the gateway tests share (the OpenAI SDK is the client everywhere else)."""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.helpers import metric_value
from tests.support.server import TritonProcess, free_port


@contextlib.contextmanager
def gateway_process(
    server: TritonProcess,
    log_dir: Path,
    models: Sequence[str] = ("tts", "tts_mono"),
    timeout_s: float = 60.0,
    extra_args: Sequence[str] = (),
) -> Iterator[str]:
    """Starts `tandem-gateway --triton ... --port ... [extra_args]` for `server` and yields its base URL once
    `/v1/models` lists every one of `models`; stops it (SIGTERM) on exit. Raises RuntimeError with
    the gateway's log when it exits or does not list them within `timeout_s`."""
    port = free_port()
    log = log_dir / "gateway.log"
    cmd = [
        str(Path(sys.executable).parent / "tandem-gateway"),
        f"--triton={server.url}",
        f"--port={port}",
        f"--metrics-url={server.metrics_url}",
        f"--models={','.join(models)}",
        *extra_args,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                    if {m["id"] for m in json.load(r)["data"]} == set(models):
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def http_get(url: str) -> tuple[int, dict[str, Any]]:
    """GET `url`: (status, JSON body), an HTTP error's included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def http_post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON: (status, {}) on success (the audio is dropped), (status, JSON) on error."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@contextlib.contextmanager
def gateway_alone(
    log_dir: Path, args: Sequence[str] = (), nofile: int | None = None, timeout_s: float = 30.0
) -> Iterator[GatewayProc]:
    """`tandem-gateway` pointed at a Triton address nobody listens on, for what the HTTP server and
    the app do before any request reaches Triton (limits, refusals, errors): it starts without
    Triton (its discovery keeps retrying) and answers `/v1/models` with an empty list. `args` are
    more command-line flags; `nofile` its RLIMIT_NOFILE (soft and hard). Yields once it answers;
    stops it (SIGTERM) on exit."""
    port = free_port()
    log = log_dir / "gateway.log"
    cmd = [
        str(Path(sys.executable).parent / "tandem-gateway"),
        f"--triton=127.0.0.1:{free_port()}",
        f"--port={port}",
        *args,
    ]

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=limit)
    gw = GatewayProc(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{gw.base}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log.read_text()}")
            time.sleep(0.1)
        yield gw
    finally:
        proc.terminate()
        proc.wait(10)


@dataclass(frozen=True)
class GatewayProc:
    base: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the gateway's /metrics samples of `name` whose labels include `labels`."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            return metric_value(r.read().decode(), name, **labels)
