"""Fault-injection harness for one real P/D unit: the tritonserver, its stubs, their engine workers.

`FaultUnit` starts the checked-in repository (without `tts_mono` unless asked: only the engine rows use
it) in explicit model-control mode. Faults are switched on the running P through the control file of the
fault hook plugged into P (tests/support/fault_hooks.py); processes are found through /proc: a
python-backend stub is a child of tritonserver whose argv[1] is `<repository>/<model>/1/model.py`, and each
stub's engine worker is its child whose command line reads `tandem-engine <model> <instance> ...`. A
dead worker is started again by its stub (serving/engine_worker.py); `tandem_engine_up` says when it
serves.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tandem.gateway.client import StreamResult, TTSClient
from tandem.serving.api_key import unit_of
from tandem.serving.health import parse_health
from tandem.serving.repository import model_parameter
from tests.support.fault_hooks import fault_parameters
from tests.support.helpers import metric_value, metrics_text
from tests.support.server import TritonProcess


def children(ppid: int) -> list[int]:
    """Pids of the direct children of `ppid` (from /proc/<pid>/stat; the comm field may hold spaces)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid and fields[0] != "Z":
            out.append(int(entry))
    return out


def stub_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def find_stub(server_pid: int, model: str) -> int | None:
    """The live python-backend stub of `model` under `server_pid`, or None."""
    for pid in children(server_pid):
        argv = stub_argv(pid)
        if len(argv) > 1 and argv[0].endswith("triton_python_backend_stub") and f"/{model}/" in argv[1]:
            return pid
    return None


def find_worker(server_pid: int, model: str) -> int | None:
    """The live engine worker (`tandem-engine <model> ...`) of `model`'s stub under `server_pid`."""
    stub = find_stub(server_pid, model)
    if stub is None:
        return None
    for pid in children(stub):
        if " ".join(stub_argv(pid)).startswith(f"tandem-engine {model} "):
            return pid
    return None


def engine_up(metrics_url: str, model: str) -> bool | None:
    """`tandem_engine_up` of `model` (its instances all up), None if not published."""
    states = [e for e in parse_health(metrics_text(metrics_url)).engines if e.model == model]
    return all(e.up for e in states) if states else None


def engine_restarts(metrics_url: str, model: str) -> float:
    try:
        return metric_value(metrics_text(metrics_url), "tandem_engine_restarts_total", model=model)
    except KeyError:
        return 0.0


def process_state(pid: int) -> str:
    """One-letter state from /proc (R, S, T = stopped, Z, ...); "" if gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


PROOFS = ("abort_ack", "done", "refused", "instance_changed", "instance_gone", "receiver_drops")


@dataclass
class Snapshot:
    """The unit's leak and verification figures at one moment."""

    d_free_pages: float
    d_held_pages: float
    p_free_pages: float
    verified_ok: float
    verified_mismatch: float
    draining: float
    admittable: float
    inflight: float
    released: dict[str, float] = field(default_factory=dict)  # failed regions freed, by proof

    @classmethod
    def take(cls, metrics_url: str) -> Snapshot:
        text = metrics_text(metrics_url)

        def get(name: str, default: float = 0.0, **labels: str) -> float:
            try:
                return metric_value(text, name, **labels)
            except KeyError:
                return default

        return cls(
            d_free_pages=get("tandem_free_pages", model="decode"),
            d_held_pages=get("tandem_held_pages", model="decode"),
            p_free_pages=get("tandem_free_pages", model="prefill"),
            verified_ok=get("tandem_kv_verifications_total", model="decode", result="ok"),
            verified_mismatch=get("tandem_kv_verifications_total", model="decode", result="mismatch"),
            draining=get("tandem_draining", model="decode"),
            admittable=get("tandem_admittable_streams", model="decode"),
            inflight=get("tandem_inflight_streams", model="decode"),
            released={
                proof: get("tandem_kv_regions_released_total", model="decode", proof=proof)
                for proof in PROOFS
            },
        )

    def released_since(self, base: Snapshot) -> dict[str, int]:
        """Failed-transfer regions freed since `base`, by proof (only proofs that occurred)."""
        delta = {p: int(self.released.get(p, 0) - base.released.get(p, 0)) for p in PROOFS}
        return {p: n for p, n in delta.items() if n}


@dataclass
class Row:
    """One line of the fault matrix."""

    row: str
    transfers_verified: int = 0
    streams: int = 0
    failed_streams: int = 0
    mismatches: int = 0
    corrupted_injected: int = 0
    released_by: dict[str, int] = field(default_factory=dict)
    leaked_d_pages: int = 0
    leaked_p_pages: int = 0
    held_pages_after: int = 0
    max_error_latency_s: float = 0.0
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


class FaultUnit:
    """One real unit under test; `start()`/`stop()` are called by the module fixture."""

    P_INSTANCE = "prefill_0_0"

    def __init__(
        self,
        workdir: Path,
        overrides: Mapping[str, Mapping[str, str]],
        groups: Mapping[str, str] | None = None,
        proxy: bool = False,
        mono: bool = False,
    ) -> None:
        """`groups`: instance groups per model (GPU placement); `proxy`: start the unit's IPC proxy
        sidecar (path `proxy`) before the server, in the server's control directory; `mono`: serve
        `tts_mono` too (the engine rows check that it streams on while P or D fails)."""
        self.workdir = workdir
        self.control_file = workdir / "faults.json"
        merged = {m: dict(v) for m, v in overrides.items()}
        merged.setdefault("prefill", {}).update(fault_parameters(control_file=str(self.control_file)))
        self.proc = TritonProcess(
            workdir, merged, extra_args=("--model-control-mode=explicit", "--load-model=*"), groups=groups
        )
        # The unit the server's repository names (a placed repository is rendered afresh, not copied).
        self.unit_name = unit_of([f"--model-repository={self.proc.repo}"])
        self.proxy: subprocess.Popen[str] | None = None
        self._want_proxy = proxy
        self.path = model_parameter(self.proc.repo, "decode", "tandem.transfer.paths") or "?"
        self.label = self.path  # how the matrix names this unit (e.g. "host_shm/region")
        self.mono = mono
        if not mono:
            shutil.rmtree(self.proc.repo / "tts_mono")  # not used by the transfer rows; saves a start
        self.rows: list[Row] = []
        self.idle: Snapshot | None = None  # the settled unit before its first row (the rows' baseline)

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def metrics_url(self) -> str:
        return self.proc.metrics_url

    @property
    def server_pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def start(self) -> FaultUnit:
        if self._want_proxy:
            run_dir = self.workdir / "run"  # the server's XDG_RUNTIME_DIR (see TritonProcess.start)
            run_dir.mkdir(mode=0o700, exist_ok=True)
            self.proxy = subprocess.Popen(
                [sys.executable, "-m", "tandem.transfer.paths.proxy_sidecar", "--unit", str(self.unit_name)],
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, "XDG_RUNTIME_DIR": str(run_dir)},
            )
            assert self.proxy.stdout is not None
            line = self.proxy.stdout.readline()
            assert "ready" in line, f"tandem-proxy did not start: {line!r}"
        self.proc.start()
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds: a unit whose P was killed may keep Triton's
        30 s exit timeout waiting on the dead stub, which the matrix has no time for."""
        p = self.proc.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(5)
            except Exception:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            self.proxy.wait(30)

    # ---- processes -------------------------------------------------------------------------------

    def stub(self, model: str) -> int:
        pid = find_stub(self.server_pid, model)
        assert pid is not None, f"no live stub for {model}"
        return pid

    def signal_stub(self, model: str, sig: signal.Signals) -> int:
        pid = self.stub(model)
        os.kill(pid, sig)
        return pid

    def worker(self, model: str) -> int:
        pid = find_worker(self.server_pid, model)
        assert pid is not None, f"no live engine worker for {model}"
        return pid

    def signal_worker(self, model: str, sig: signal.Signals) -> int:
        pid = self.worker(model)
        os.kill(pid, sig)
        return pid

    def wait_engine(self, model: str, up: bool, timeout_s: float) -> float:
        """Wait until `tandem_engine_up` of `model` reads `up`; returns the seconds it took."""
        t0 = time.monotonic()
        while engine_up(self.metrics_url, model) is not up:
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"{model}: tandem_engine_up not {int(up)} within {timeout_s} s")
            time.sleep(0.05)
        return time.monotonic() - t0

    def signal_proxy(self, sig: signal.Signals) -> int:
        """Signal the unit's `tandem-proxy` sidecar (path `proxy` only)."""
        assert self.proxy is not None and self.proxy.poll() is None, "this unit has no running proxy"
        os.kill(self.proxy.pid, sig)
        return self.proxy.pid

    # ---- faults and figures ----------------------------------------------------------------------

    def set_faults(self, **values: float) -> None:
        """Replace P's fault control file (atomically: a rename gives it a new inode)."""
        tmp = self.control_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(values))
        os.replace(tmp, self.control_file)

    def clear_faults(self) -> None:
        self.control_file.unlink(missing_ok=True)

    def snapshot(self) -> Snapshot:
        return Snapshot.take(self.metrics_url)

    def wait_for(
        self, predicate: Callable[[Snapshot], bool], timeout_s: float, what: str, *, stable_s: float = 0.0
    ) -> Snapshot:
        """The first snapshot for which `predicate` holds; with `stable_s`, it must still hold in a
        snapshot taken that long later (the gauges publish every ~0.1 s, one at a time: one reading
        can mix two publications)."""
        deadline = time.monotonic() + timeout_s
        snap = self.snapshot()
        while True:
            if predicate(snap):
                if stable_s <= 0:
                    return snap
                time.sleep(stable_s)
                again = self.snapshot()
                if predicate(again):
                    return again
                snap = again
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not reached in {timeout_s} s; last {snap}")
            time.sleep(0.1)
            snap = self.snapshot()

    def settle(self, baseline: Snapshot, timeout_s: float = 15.0, *, p_pages: bool = False) -> Snapshot:
        """Wait until no stream is in flight and D's pages (free and held) are back to `baseline`,
        in two readings 0.3 s apart; with `p_pages`, P's free pages too."""
        return self.wait_for(
            lambda s: (
                s.inflight == 0
                and s.d_held_pages == 0
                and s.d_free_pages == baseline.d_free_pages
                and s.draining == 0
                and (not p_pages or s.p_free_pages >= baseline.p_free_pages)
            ),
            timeout_s,
            "D back to baseline" + (" and P pages back" if p_pages else ""),
            stable_s=0.3,
        )

    def matrix(self) -> dict[str, Any]:
        """The rows run so far, for the JSON record (every row already asserted 0 undetected)."""
        return {
            "verified_transfers_total": sum(r.transfers_verified for r in self.rows),
            "mismatches_undetected": 0,
            "rows": [asdict(r) for r in self.rows],
        }


def format_matrix(rows: list[Row]) -> str:
    head = (
        f"{'row':<34}{'verified':>9}{'streams':>8}{'failed':>7}{'mismatch':>9}"
        f"{'leak D':>7}{'leak P':>7}{'err<=s':>8}{'secs':>7}  freed by"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.row:<34}{r.transfers_verified:>9}{r.streams:>8}{r.failed_streams:>7}{r.mismatches:>9}"
            f"{r.leaked_d_pages:>7}{r.leaked_p_pages:>7}{r.max_error_latency_s:>8.2f}{r.seconds:>7.1f}  "
            + " ".join(f"{p}:{n}" for p, n in r.released_by.items())
        )
    lines.append(f"{'total':<34}{sum(r.transfers_verified for r in rows):>9}")
    return "\n".join(lines)


class Background:
    """Runs `fn` on a thread and keeps its result or exception (for load that a fault hits)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._t.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # re-raised by join() in the test's thread
            self.error = exc

    def running(self) -> bool:
        return self._t.is_alive()

    def join(self, timeout_s: float) -> Any:
        self._t.join(timeout_s)
        assert not self._t.is_alive(), f"background load still running after {timeout_s} s"
        if self.error is not None:
            raise self.error
        return self.result


def streams(
    url: str, jobs: list[tuple[np.ndarray, dict[str, Any]]], timeout_s: float = 60.0, model: str = "tts"
) -> list[StreamResult]:
    """Every job as its own client and stream, all at once; each result has a client-side error or rows.
    A stream that gets no final response within `timeout_s` is reported as an error, not raised."""
    clients = [TTSClient(url, model) for _ in jobs]
    try:
        keys = [c.send(p, **kw) for c, (p, kw) in zip(clients, jobs, strict=True)]
        out = []
        deadline = time.monotonic() + timeout_s
        for c, k in zip(clients, keys, strict=True):
            try:
                out.append(c.wait([k], max(0.1, deadline - time.monotonic()))[0])
            except TimeoutError:
                r = StreamResult(stream_id=int(k), error=f"no final response in {timeout_s} s")
                out.append(r)
        return out
    finally:
        for c in clients:
            c.close(cancel=True)


def volume(url: str, n_requests: int, n_clients: int, seed: int = 0) -> tuple[int, list[str]]:
    """`n_requests` short streams (MAX_TOKENS 2..3, so every one crosses P -> D) over `n_clients`
    persistent connections, each sending its next request when the previous one ends. Returns the
    number of streams that finished with the right row count and the errors of the others."""
    rng = np.random.default_rng(seed)
    plan = [(int(rng.integers(4, 120)), int(rng.integers(2, 4))) for _ in range(n_requests)]
    ok = [0] * n_clients
    errors: list[str] = []
    lock = threading.Lock()
    next_i = [0]

    def worker(w: int) -> None:
        with TTSClient(url, "tts") as c:
            while True:
                with lock:
                    i = next_i[0]
                    next_i[0] += 1
                if i >= n_requests:
                    return
                rows, max_tokens = plan[i]
                x = np.random.default_rng(seed * 100_003 + i).integers(
                    0, 1024, size=(rows, 4), dtype=np.int64
                )
                r = c.run(x, timeout_s=60, MAX_TOKENS=max_tokens, TEMPERATURE=0.0)
                if r.error is None and r.rows is not None and r.rows.shape[0] == max_tokens:
                    ok[w] += 1
                else:
                    with lock:
                        errors.append(str(r.error))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(ok), errors


def arrivals(
    url: str, model: str, n: int, every_s: float, seed: int, rows: int = 20, max_tokens: int = 5
) -> Background:
    """`n` one-shot streams to `model`, one started every `every_s` (traffic that keeps arriving while
    a fault lasts); the Background's result is their StreamResults in start order."""

    def go() -> list[StreamResult]:
        out: list[StreamResult | None] = [None] * n

        def one(i: int) -> None:
            x = np.random.default_rng(seed * 1000 + i).integers(0, 1024, size=(rows + i, 4), dtype=np.int64)
            with TTSClient(url, model) as c:
                out[i] = c.run(x, timeout_s=60, MAX_TOKENS=max_tokens, TEMPERATURE=0.0)

        threads = []
        for i in range(n):
            t = threading.Thread(target=one, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(every_s)
        for t in threads:
            t.join(90)
        assert all(r is not None for r in out), "an arrival did not finish"
        return [r for r in out if r is not None]

    return Background(go)


def server_ready(url: str, models: tuple[str, ...]) -> bool:
    """The server and every model in `models` report ready (Triton's own view)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        return bool(client.is_server_ready()) and all(client.is_model_ready(m) for m in models)
    except Exception:
        return False
    finally:
        client.close()
