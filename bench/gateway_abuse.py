"""tandem-bench-gateway-abuse: the gateway's HTTP bounds at full scale, with the default limits.

    tandem-bench-gateway-abuse [--triton HOST:GRPC_PORT] [--idle 20000] [--out FILE.json]

Starts `tandem-gateway` (default: at a Triton address nobody listens on; everything measured here
is decided before a request reaches Triton) and measures:

- `bystander_baseline`: a bystander's `GET /v1/models`, connect to first byte, nothing else running.
- `idle`: one client (its own process, source address 127.0.0.2) opens `--idle` connections, sends
  each a partial request head and then a byte a second; the bystander (127.0.0.1) is sampled every
  50 ms while they are being opened (`bystander_opening`) and while they are held
  (`bystander_held`); what the client's connections got (503 at once past the cap per client, 408
  at the header timeout).
- `bodies`: eight concurrent 100 MB bodies, sent while reading (Content-Length and chunked to the
  speech route, Content-Length to the voices route): each answer's status and time, the bytes sent
  by then, and the gateway's RSS growth (peak VmRSS over the run minus before).
- `websockets`: one client (127.0.0.2) opens `--websockets` connections that upgrade to the
  stream-input WebSocket and holds them: how many upgraded (the cap per client counts them), how
  many were refused, the gauge of open connections, a bystander's latency meanwhile, and the
  gateway's RSS before, while held and after they closed.
- `log_lines`: the gateway's log, lines in all and refusal lines (summarised repeats).

Prints a table and writes JSON (commit, machine, every sample) to `--out`.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tandem.bench.http_abuse import IdleHolder, RssSampler, big_bodies, first_byte, rss_bytes, websocket_flood
from tandem.bench.util import format_table, provenance, quantile, write_json

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _start(triton: str, log: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = _free_port()
    cmd = [
        str(Path(sys.executable).parent / "tandem-gateway"),
        f"--triton={triton}",
        f"--port={port}",
        *extra,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/v1/models", timeout=2):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"gateway did not start:\n{log.read_text()}")


def _gauge(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return float("nan")


def _stats(samples: list[tuple[float, int]]) -> dict[str, Any]:
    ms = [t * 1e3 for t, _ in samples]
    statuses: dict[str, int] = {}
    for _, s in samples:
        statuses[str(s)] = statuses.get(str(s), 0) + 1
    if not ms:
        return {"n": 0}
    p50, p99 = quantile(ms, 0.5), quantile(ms, 0.99)
    return {"n": len(ms), "p50_ms": p50, "p99_ms": p99, "max_ms": max(ms), "statuses": statuses}


def _sample_until(port: int, done: Any, every_s: float = 0.05) -> list[tuple[float, int]]:
    out = []
    while not done():
        out.append(first_byte(HOST, port))
        time.sleep(every_s)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-gateway-abuse", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--triton", default=None, help="Triton's gRPC endpoint (default: an address nobody serves)"
    )
    ap.add_argument("--idle", type=int, default=20_000, help="idle connections one client holds")
    ap.add_argument("--hold", type=float, default=15.0, help="seconds the client holds them")
    ap.add_argument("--body-mb", type=int, default=100, help="size of each huge body, MB")
    ap.add_argument("--websockets", type=int, default=2000, help="WebSockets one client opens")
    ap.add_argument("--gateway-arg", action="append", default=[], help="more tandem-gateway flags")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/gateway-abuse-cpu.json"))
    args = ap.parse_args(argv)
    triton = args.triton or f"{HOST}:{_free_port()}"
    log = Path(tempfile.mkdtemp(prefix="tandem-gw-abuse-")) / "gateway.log"
    proc, port = _start(triton, log, args.gateway_arg)
    result: dict[str, Any] = {
        "provenance": provenance(torch.device("cpu"), "tandem-bench-gateway-abuse", argv)
    }
    try:
        result["gateway_start_log"] = [ln for ln in log.read_text().splitlines() if "at most" in ln]
        result["bystander_baseline"] = _stats([first_byte(HOST, port) for _ in range(50)])

        holder = IdleHolder(HOST, port, args.idle, src="127.0.0.2", hold_s=args.hold).start()
        try:
            t0 = time.monotonic()
            opening = _sample_until(port, lambda: holder.ready)
            holder.wait_ready()
            opened_s = time.monotonic() - t0
            held = _sample_until(port, lambda: time.monotonic() > t0 + opened_s + args.hold - 2)
            report = holder.report()
        finally:
            holder.kill()
        result["idle"] = {
            "client": asdict(report),
            "opened_s": opened_s,
            "bystander_opening": _stats(opening),
            "bystander_held": _stats(held),
            "gateway_rss_after_mib": RssSampler(proc.pid).before / 2**20,
        }

        bodies = {}
        cases = {
            "speech_content_length": ("/v1/audio/speech", False, "application/json"),
            "speech_chunked": ("/v1/audio/speech", True, "application/json"),
            "voices_content_length": ("/v1/voices", False, "multipart/form-data; boundary=b"),
        }
        for name, (path, chunked, ctype) in cases.items():
            with RssSampler(proc.pid) as rss:
                res = big_bodies(HOST, port, path, 8, args.body_mb * 10**6, chunked, ctype)
            bodies[name] = {
                "statuses": [r.status for r in res],
                "answer_s": [r.first_byte_s for r in res],
                "sent_before_answer_bytes": [r.sent_bytes for r in res],
                "message": res[0].message if res else "",
                "rss_before_mib": rss.before / 2**20,
                "rss_growth_mib": rss.growth / 2**20,
            }
        result["bodies"] = bodies

        rss_before = rss_bytes(proc.pid)
        held, statuses = websocket_flood(
            HOST, port, args.websockets, "127.0.0.2", "/v1/audio/speech/stream-input"
        )
        try:
            during = [first_byte(HOST, port) for _ in range(50)]
            gauge = _gauge(port, "tandem_gateway_connections")
            rss_held = rss_bytes(proc.pid)
        finally:
            for sock in held:
                sock.close()
        time.sleep(3.0)  # the gateway sees the closes
        result["websockets"] = {
            "asked": args.websockets,
            "statuses": statuses,
            "connections_gauge_while_held": gauge,
            "connections_gauge_after": _gauge(port, "tandem_gateway_connections"),
            "bystander_held": _stats(during),
            "rss_before_mib": rss_before / 2**20,
            "rss_held_mib": rss_held / 2**20,
            "rss_after_mib": rss_bytes(proc.pid) / 2**20,
        }
    finally:
        proc.terminate()
        proc.wait(15)
    text = log.read_text()
    result["log_lines"] = {
        "total": len(text.splitlines()),
        "refused": text.count("refused a connection"),
        "closed": text.count("closed a connection"),
        "too_many_open_files": text.count("Too many open files"),
    }

    idle = result["idle"]
    rows = []
    for label, st in (
        ("baseline", result["bystander_baseline"]),
        (f"while {args.idle} open", idle["bystander_opening"]),
        (f"while {args.idle} held", idle["bystander_held"]),
    ):
        rows.append([label, st.get("p50_ms", 0.0), st.get("max_ms", 0.0), st.get("statuses", {})])
    print(format_table(["bystander first byte", "p50 ms", "max ms", "statuses"], rows))
    print(f"idle client: {idle['client']} (opened in {idle['opened_s']:.1f} s)")
    rows = []
    for name, b in result["bodies"].items():
        sent_mb = max(b["sent_before_answer_bytes"]) / 1e6
        rows.append(
            [name, sorted(set(b["statuses"])), max(b["answer_s"]) * 1e3, sent_mb, b["rss_growth_mib"]]
        )
    print(format_table(["8 x 100 MB", "statuses", "max answer ms", "max sent MB", "RSS growth MiB"], rows))
    ws = result["websockets"]
    print(
        f"{ws['asked']} WebSockets from one address: {ws['statuses']}; connections gauge"
        f" {ws['connections_gauge_while_held']:.0f} held, {ws['connections_gauge_after']:.0f} after;"
        f" bystander max {ws['bystander_held'].get('max_ms', 0):.1f} ms; RSS {ws['rss_before_mib']:.1f} ->"
        f" {ws['rss_held_mib']:.1f} held -> {ws['rss_after_mib']:.1f} MiB after"
    )
    print(f"gateway log: {result['log_lines']}")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
