"""GPU KV hand-off benchmark: P process on GPU0 -> D process on GPU1, per transfer path.

    python -m tandem.cli.bench_gpu_transfer [--paths cuda_ipc,cuda_vmm,proxy] [--iters 30] [--out DIR]

Moves one request's KV — 2048 tokens of the qwen3-4b shape (36 layers, 8 KV heads, head_dim 128, bf16:
288 MiB) — from P's paged pool to D's, through each path, with the pool unfragmented (72 chunks: one
contiguous run per layer and K/V) and fragmented (page size 1, shuffled slots: ~147k chunks). Figures
(medians of `--iters` after `--warmup`):

* `e2e`   — P: gather + `copy_to_peer` (synchronised wall clock) plus D: scatter (CUDA events);
            the control-socket round trips between them are not counted.
* `cross` — `copy_to_peer` alone on an already gathered staging buffer (synchronised wall clock).
* `gather`/`scatter` — the kernels alone (CUDA events); `fused` — P's gather kernel writing straight
            into D's arena through the mapping (cuda_ipc / cuda_vmm only; no staging to checksum).
Baselines in the same run: the in-process contiguous copy GPU0 -> GPU1 and the raw legacy IPC copy
(cudaIpcOpenMemHandle + cudaMemcpyAsync, CUDA events). Each (path, pool) case ends with one verified
transfer (P's staging checksum == D's region checksum, D's pool rows == the region).
Prints a table; writes `gpu-transfer-<tag>.json` and `.png` into `--out` (and `--docs-dir`).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path
from typing import Any

import torch

from tandem.csrc import kv_cuda
from tandem.transfer import Region, TransferPath, WireLayout, kv_checksum

CTX = mp.get_context("spawn")


def make_path(name: str, device: int, unit: str) -> TransferPath:
    from tandem.transfer.cuda_paths import CudaIpcPath, CudaVmmPath
    from tandem.transfer.proxy_path import ProxyPath

    if name == "cuda_ipc":
        return CudaIpcPath(device)
    if name == "cuda_vmm":
        return CudaVmmPath(device)
    if name == "proxy":
        return ProxyPath(unit=unit, device=device)
    raise SystemExit(f"unknown path {name!r}")


def slot_sets(pool_slots: int, n_tokens: int, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "unfragmented": torch.arange(n_tokens, dtype=torch.int64).add_(pool_slots // 4).to(device),
        "fragmented": torch.randperm(pool_slots, generator=g)[:n_tokens].to(device),
    }


def chunks(slots: torch.Tensor, num_lt: int) -> int:
    s = slots.cpu()
    return num_lt * (1 + int((s[1:] - s[:-1] != 1).sum()))


def _events_ms(fn: Callable[[], object], device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return float(start.elapsed_time(end))


# ---- child processes ---------------------------------------------------------------------------------


def d_child(
    path_name: str,
    device: int,
    layout_d: dict[str, Any],
    n_tokens: int,
    pool_slots: int,
    unit: str,
    conn: Connection,
) -> None:
    """D: owns the receive arena and a pool; scatters the region into the pool on request."""
    try:
        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        layout = WireLayout.from_dict(layout_d)
        path = make_path(path_name, device, unit)
        nbytes = layout.staging_nbytes(n_tokens)
        arena = path.create_arena(-(-nbytes // 4096) * 4096, "bench")
        exp = arena.export()
        conn.send(("export", exp.meta, len(exp.fds), getattr(path, "handle_type", path_name)))
        for fd in exp.fds:
            send_handle(conn, fd, os.getppid())
        region = (
            arena.region_bytes(Region(0, nbytes, nbytes))
            .view(layout.dtype)
            .view(layout.staging_shape(n_tokens))
        )
        pool = torch.zeros(layout.staging_shape(pool_slots), dtype=layout.dtype, device=dev)
        slots = slot_sets(pool_slots, n_tokens, 2, dev)
        while True:
            cmd = conn.recv()
            if cmd[0] == "scatter":
                s = slots[cmd[1]]
                conn.send(
                    _events_ms(functools.partial(kv_cuda.scatter, region, pool, s, check_bounds=False), dev)
                )
            elif cmd[0] == "verify":
                s = slots[cmd[1]]
                pool.view(torch.uint8).fill_(0xA5)  # poison: every row at the slots must be written
                kv_cuda.scatter(region, pool, s)
                back = torch.index_select(pool, 2, s)
                conn.send(
                    (kv_checksum(region), bool(torch.equal(back.view(torch.uint8), region.view(torch.uint8))))
                )
            elif cmd[0] == "stop":
                arena.close()
                conn.send("stopped")
                return
    except Exception as exc:
        conn.send(("error", f"D: {type(exc).__name__}: {exc}"))
        raise


def p_child(
    path_name: str,
    device: int,
    layout_d: dict[str, Any],
    n_tokens: int,
    pool_slots: int,
    unit: str,
    conn: Connection,
) -> None:
    """P: owns a random pool; gathers and copies into D's arena through the path."""
    try:
        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        layout = WireLayout.from_dict(layout_d)
        path = make_path(path_name, device, unit)
        _, meta, n_fds, _ = conn.recv()
        fds = [recv_handle(conn) for _ in range(n_fds)]
        peer = path.open_peer_arena(meta, fds)
        pool = torch.randn(layout.staging_shape(pool_slots), device=dev).to(layout.dtype)
        slots = slot_sets(pool_slots, n_tokens, 1, dev)
        staging = path.alloc_staging(layout, n_tokens)
        k = kv_cuda.module()
        assert k is not None
        num_lt, row_bytes = layout.num_layers * 2, layout.token_bytes // (layout.num_layers * 2)
        nbytes = layout.staging_nbytes(n_tokens)
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "e2e":  # gather + crossing copy, one synchronised wall-clock interval
                s = slots[cmd[1]]
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                kv_cuda.gather(pool, s, staging, check_bounds=False)
                path.copy_to_peer(staging, peer, 0)
                conn.send((time.perf_counter() - t0) * 1e3)
            elif cmd[0] == "stages":
                s, n = slots[cmd[1]], cmd[2]
                gather = [
                    _events_ms(functools.partial(kv_cuda.gather, pool, s, staging, check_bounds=False), dev)
                    for _ in range(n)
                ]
                cross = []
                for _ in range(n):
                    torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    path.copy_to_peer(staging, peer, 0)
                    cross.append((time.perf_counter() - t0) * 1e3)
                fused: list[float] = []
                raw: list[float] = []
                if isinstance(getattr(peer, "ptr", None), int):
                    stream = int(torch.cuda.current_stream(dev).cuda_stream)
                    ptr = int(peer.ptr)
                    to_peer = functools.partial(
                        k.gather,
                        pool.data_ptr(),
                        pool_slots,
                        s.data_ptr(),
                        ptr,
                        num_lt,
                        n_tokens,
                        row_bytes,
                        device,
                        stream,
                    )  # the gather kernel writing D's arena directly over NVLink
                    fused = [_events_ms(to_peer, dev) for _ in range(n)]
                    raw_copy = functools.partial(
                        k.memcpy_async, device, ptr, staging.data_ptr(), nbytes, stream
                    )
                    raw = [_events_ms(raw_copy, dev) for _ in range(n)]  # event-timed like the baseline
                conn.send(
                    {
                        "gather": gather,
                        "cross": cross,
                        "fused": fused,
                        "raw_copy": raw,
                        "chunks": chunks(s, num_lt),
                    }
                )
            elif cmd[0] == "verify":
                s = slots[cmd[1]]
                staging.view(torch.uint8).fill_(0x5A)
                kv_cuda.gather(pool, s, staging)
                ok = bool(torch.equal(staging, torch.index_select(pool, 2, s)))
                checksum = kv_checksum(staging)
                path.copy_to_peer(staging, peer, 0)
                conn.send((checksum, ok))
            elif cmd[0] == "stop":
                peer.close()
                conn.send("stopped")
                return
    except Exception as exc:
        conn.send(("error", f"P: {type(exc).__name__}: {exc}"))
        raise


def baseline_child(
    layout_d: dict[str, Any], n_tokens: int, iters: int, warmup: int, conn: Connection
) -> None:
    """In-process contiguous copy GPU0 -> GPU1 (and same-GPU D2D for scale), CUDA events."""
    try:
        layout = WireLayout.from_dict(layout_d)
        n = layout.staging_nbytes(n_tokens)
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        out: dict[str, list[float]] = {}
        if torch.cuda.device_count() > 1:
            dst = torch.empty(n, dtype=torch.uint8, device="cuda:1")
            for _ in range(warmup):
                dst.copy_(src)
            torch.cuda.synchronize()
            out["inprocess_p2p"] = [
                _events_ms(functools.partial(dst.copy_, src), src.device) for _ in range(iters)
            ]
            assert torch.equal(dst.cpu(), src.cpu())
        same = torch.empty_like(src)
        out["same_gpu_d2d"] = [
            _events_ms(functools.partial(same.copy_, src), src.device) for _ in range(iters)
        ]
        conn.send(out)
    except Exception as exc:
        conn.send(("error", f"baseline: {type(exc).__name__}: {exc}"))
        raise


# ---- parent ------------------------------------------------------------------------------------------


def _recv(conn: Connection, timeout: float = 300.0) -> Any:
    if not conn.poll(timeout):
        raise RuntimeError("child did not answer in time")
    msg = conn.recv()
    if isinstance(msg, tuple) and msg and msg[0] == "error":
        raise RuntimeError(msg[1])
    return msg


def _spawn(target: Callable[..., None], args: tuple[Any, ...], visible: str | None) -> tuple[Any, Connection]:
    parent, child = CTX.Pipe()
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        proc = CTX.Process(target=target, args=(*args, child), daemon=True)
        proc.start()
    finally:
        if visible is not None:
            if old is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = old
    return proc, parent


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def run_path(name: str, args: argparse.Namespace, layout: WireLayout, unit: str) -> dict[str, Any]:
    proxy = None
    issue = "src" if name == "proxy_src" else "dst"
    name = "proxy" if name.startswith("proxy") else name
    if name == "proxy":
        proxy = subprocess.Popen(
            [sys.executable, "-m", "tandem.transfer.proxy", "--unit", unit, "--issue", issue],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proxy.stdout is not None
        line = proxy.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"proxy did not start: {line!r} (exit {proxy.poll()})")
    # cuda_ipc/cuda_vmm: both processes see both GPUs (P uses 0, D uses 1); proxy: each sees only its own.
    p_dev, d_dev, p_vis, d_vis = (0, 0, "0", "1") if name == "proxy" else (0, 1, None, None)
    common = (layout.to_dict(), args.tokens, args.pool_slots, unit)
    d_proc, d = _spawn(d_child, (name, d_dev, *common), d_vis)
    p_proc, p = _spawn(p_child, (name, p_dev, *common), p_vis)
    try:
        export = _recv(d)
        p.send(export)
        for _ in range(export[2]):  # fds: D -> parent -> P
            fd = recv_handle(d)
            send_handle(p, fd, p_proc.pid)
            os.close(fd)
        assert _recv(p) == "ready"
        result: dict[str, Any] = {"handle_type": export[3], "cases": {}}
        for case in ("unfragmented", "fragmented"):
            for _ in range(args.warmup):
                p.send(("e2e", case))
                _recv(p)
                d.send(("scatter", case))
                _recv(d)
            e2e, scatter = [], []
            for _ in range(args.iters):
                p.send(("e2e", case))
                pw = _recv(p)
                d.send(("scatter", case))
                sc = _recv(d)
                e2e.append(pw + sc)
                scatter.append(sc)
            p.send(("stages", case, args.iters))
            st = _recv(p)
            p.send(("verify", case))
            p_sum, gather_ok = _recv(p)
            d.send(("verify", case))
            d_sum, scatter_ok = _recv(d)
            result["cases"][case] = {
                "chunks": st["chunks"],
                "e2e_ms": med(e2e),
                "cross_ms": med(st["cross"]),
                "gather_ms": med(st["gather"]),
                "scatter_ms": med(scatter),
                "fused_gather_to_peer_ms": med(st["fused"]),
                "raw_ipc_copy_ms": med(st["raw_copy"]),
                "verified": bool(p_sum == d_sum and gather_ok and scatter_ok),
                "samples": {"e2e": e2e, "cross": st["cross"]},
            }
            print(
                f"  {name} {case}: e2e {med(e2e):.3f} ms, cross {med(st['cross']):.3f} ms, "
                f"verified {result['cases'][case]['verified']}",
                flush=True,
            )
        return result
    finally:
        for c in (p, d):
            try:
                c.send(("stop",))
                _recv(c, 30)
            except Exception:
                pass
        for proc in (p_proc, d_proc):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        if proxy is not None:
            proxy.terminate()
            proxy.wait(30)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, e2e, cross = [], [], []
    for name, res in report["paths"].items():
        for case, c in res.get("cases", {}).items():
            labels.append(f"{name}\n{case[:5]}")
            e2e.append(c["e2e_ms"])
            cross.append(c["cross_ms"])
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], e2e, 0.4, label="gather + cross + scatter")
    ax.bar([x + 0.2 for x in xs], cross, 0.4, label="crossing copy alone")
    base = report["baselines"].get("inprocess_p2p_ms")
    if base:
        ax.axhline(base, color="k", ls="--", lw=1, label=f"in-process P2P copy {base:.3f} ms")
    ax.axhline(0.85, color="r", ls=":", lw=1, label="target 0.85 ms")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"288 MiB KV hand-off, {report['device']['name']} x{report['device']['count']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def commit() -> str:
    if os.environ.get("TANDEM_COMMIT"):
        return os.environ["TANDEM_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paths", default="cuda_ipc,cuda_vmm,proxy,proxy_src")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--pool-slots", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tag", default="h200x2")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--docs-dir", default="docs/benchmarks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_transfer: CUDA not available")
    if kv_cuda.module() is None:
        raise SystemExit(f"bench_gpu_transfer: {kv_cuda.build_info()}")
    os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="tandem-bench-"))
    layout = WireLayout(args.layers, args.kv_heads, args.head_dim, args.dtype)
    mib = layout.staging_nbytes(args.tokens) / 2**20
    print(f"bench_gpu_transfer: {args.tokens} tokens x {layout.token_bytes} B = {mib:.0f} MiB", flush=True)
    proc, conn = _spawn(baseline_child, (layout.to_dict(), args.tokens, args.iters, args.warmup), None)
    base_raw = _recv(conn)
    proc.join(30)
    baselines = {f"{k}_ms": med(v) for k, v in base_raw.items()}
    report: dict[str, Any] = {
        "commit": commit(),
        "device": {
            "name": torch.cuda.get_device_name(0),
            "count": torch.cuda.device_count(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
        },
        "config": {**vars(args), "mib": mib, "median_of": args.iters},
        "baselines": baselines,
        "paths": {},
    }
    for i, name in enumerate(args.paths.split(",")):
        print(f"path {name}", flush=True)
        try:
            report["paths"][name] = run_path(name, args, layout, f"bench{os.getpid()}-{i}")
        except Exception as exc:
            print(f"  {name} FAILED: {exc}", flush=True)
            report["paths"][name] = {"error": str(exc)}
    base = baselines.get("inprocess_p2p_ms")
    rows = [("case", "chunks", "e2e", "cross", "gather", "scatter", "fused", "raw_ipc", "ok")]
    for name, res in report["paths"].items():
        for case, c in res.get("cases", {}).items():
            f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            rows.append(
                (
                    f"{name}/{case}",
                    str(c["chunks"]),
                    f(c["e2e_ms"]),
                    f(c["cross_ms"]),
                    f(c["gather_ms"]),
                    f(c["scatter_ms"]),
                    f(c["fused_gather_to_peer_ms"]),
                    f(c["raw_ipc_copy_ms"]),
                    str(c["verified"]),
                )
            )
            c["cross_vs_inprocess"] = None if not base else base / c["cross_ms"]
            c["e2e_vs_inprocess"] = None if not base else base / c["e2e_ms"]
        cases = res.get("cases", {})
        if len(cases) == 2:
            u, fr = cases["unfragmented"], cases["fragmented"]
            res["fragmentation_change_e2e"] = fr["e2e_ms"] / u["e2e_ms"] - 1
            res["fragmentation_change_cross"] = fr["cross_ms"] / u["cross_ms"] - 1
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"\nbaselines (ms): {json.dumps({k: round(v, 4) for k, v in baselines.items() if v})}")
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-transfer-{args.tag}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out / f"{stem}.png")
    if args.docs_dir:
        docs = Path(args.docs_dir)
        docs.mkdir(parents=True, exist_ok=True)
        for ext in ("json", "png"):
            (docs / f"{stem}.{ext}").write_bytes((out / f"{stem}.{ext}").read_bytes())
    print(f"wrote {out / stem}.json/.png", flush=True)


if __name__ == "__main__":
    main()
