"""GPU KV hand-off benchmark: P process on GPU0 -> D process on GPU1, per transfer path.

    python -m tandem.bench.gpu_transfer [--paths cuda_ipc,cuda_vmm,proxy] [--iters 30] [--out DIR]

Moves one request's KV — 2048 tokens of the qwen3-4b shape (36 layers, 8 KV heads, head_dim 128, bf16:
288 MiB) — from P's paged pool to D's, through each path, with the pool unfragmented (72 chunks: one
contiguous run per layer and K/V) and fragmented (page size 1, shuffled slots: ~147k chunks). Figures
(medians of `--iters` after `--warmup`):

* `e2e`   — P: gather + `copy_to_peer` (synchronised wall clock) plus D: scatter (CUDA events);
            the control-socket round trips between them are not counted.
* `cross` — `copy_to_peer` alone on an already gathered staging buffer (synchronised wall clock).
* `gather`/`scatter` — the kernels alone (CUDA events); `fused` — P's gather kernel writing straight
            into D's arena through the mapping (cuda_ipc / cuda_vmm only; no staging to checksum).
* `direct` — direct mode (paths with `direct_write`: cuda_ipc, cuda_vmm, proxy), the whole hand-off: D's pool
            *is* a second arena (`LocalArena.pool_view`, `--pool-slots` tokens), and P's
            `TransferPath.write_rows` reads its pool's rows and writes D's pages at D's slots in one
            kernel (synchronised wall clock of the call; no gather, crossing copy or scatter). In the
            fragmented case P's source slots and D's destination slots are independent shuffles, in
            the unfragmented case both are one contiguous run. `p_checksum`/`d_checksum` — the
            integrity cost of direct mode: `kv_checksum_rows` over P's rows (the sender, before the
            write) and over D's destination rows (D, after DONE), each a synchronised wall clock.
Baselines in the same run: the in-process contiguous copy GPU0 -> GPU1 and the raw legacy IPC copy
(cudaIpcOpenMemHandle + cudaMemcpyAsync, CUDA events). Each (path, pool) case ends with one verified
transfer (P's staging checksum == D's region checksum, D's pool rows == the region), and with direct
mode one more: D's pool poisoned, one `write_rows`, then D's `kv_checksum_rows` == P's, the sha256 of
D's rows at its slots == that of P's rows at its slots, P's row checksum == `kv_checksum` of the
gathered rows, no row of D's pool outside its slots touched, and P's view of D's pool the mapping itself
(`direct_checks`, `direct_verified`). Direct mode runs after both region cases, so its failure
(`direct_error`) leaves their figures in place.
Prints a table; writes `gpu-transfer-<tag>.json` and `.png` into `--out` (and `--docs-dir`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
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
P_SEED, D_SEED = 1, 2  # slot shuffles: P's source slots, D's destination slots (direct mode and scatter)
DIRECT_FIELDS: dict[str, Any] = {  # per case; stay None on paths without `direct_write`
    "direct_ms": None,
    "direct_samples": None,
    "direct_dst_chunks": None,
    "p_checksum_ms": None,
    "d_checksum_ms": None,
    "p_checksum_samples": None,
    "d_checksum_samples": None,
    "checksum_kernel": None,
    "direct_checks": None,
    "direct_verified": None,
}


def make_path(name: str, device: int, unit: str) -> TransferPath:
    from tandem.transfer.paths.cuda import CudaIpcPath, CudaVmmPath
    from tandem.transfer.paths.proxy import ProxyPath

    if name == "cuda_ipc":
        return CudaIpcPath(device)
    if name == "cuda_vmm":
        return CudaVmmPath(device)
    if name == "proxy":
        return ProxyPath(unit=unit, device=device, direct=True)  # measure direct mode too (off in engines)
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


def _wall_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall clock of `fn` after a device sync; for calls that return only once their work is done
    (`write_rows` synchronises its copy stream, `kv_checksum_rows` reads its result back)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _sha256_rows(pool: torch.Tensor, slots: torch.Tensor) -> str:
    """sha256 of the rows `pool[:, :, slots]` in slot order, copied to the host (independent of the
    checksum kernel under test)."""
    rows = torch.index_select(pool, 2, slots).cpu().contiguous()
    return hashlib.sha256(rows.view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()


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
    """D: owns the receive arena and a pool; scatters the region into the pool on request. With a
    `direct_write` path also a second arena that is its direct-mode pool (P writes it, D hashes it)."""
    try:
        from tandem.transfer.checksum import kv_checksum_rows

        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        layout = WireLayout.from_dict(layout_d)
        path = make_path(path_name, device, unit)
        nbytes = layout.staging_nbytes(n_tokens)
        arena = path.create_arena(-(-nbytes // 4096) * 4096, "bench")
        exp = arena.export()
        pool_arena = None
        pool_meta: dict[str, int | str] | None = None
        pool_fds: tuple[int, ...] = ()
        if path.direct_write:  # like the real D in direct mode: the pool IS the arena, exactly S slots
            pool_arena = path.create_arena(pool_slots * layout.token_bytes, "bench-pool")
            pool_exp = pool_arena.export()
            pool_meta, pool_fds = pool_exp.meta, pool_exp.fds
        conn.send(
            (
                "export",
                exp.meta,
                len(exp.fds),
                getattr(path, "handle_type", path_name),
                pool_meta,
                len(pool_fds),
            )
        )
        for fd in (*exp.fds, *pool_fds):
            send_handle(conn, fd, os.getppid())
        region = (
            arena.region_bytes(Region(0, nbytes, nbytes))
            .view(layout.dtype)
            .view(layout.staging_shape(n_tokens))
        )
        pool = torch.zeros(layout.staging_shape(pool_slots), dtype=layout.dtype, device=dev)
        d_pool = None if pool_arena is None else pool_arena.pool_view(layout)
        slots = slot_sets(pool_slots, n_tokens, D_SEED, dev)
        while True:
            cmd = conn.recv()
            if cmd[0] == "d_checksum":  # D's integrity cost in direct mode: hash its rows after DONE
                assert d_pool is not None
                fn = functools.partial(kv_checksum_rows, d_pool, slots[cmd[1]])
                for _ in range(cmd[2]):
                    fn()
                conn.send([_wall_ms(fn, dev) for _ in range(cmd[3])])
            elif cmd[0] == "direct_poison":  # every row P writes must change; no other row may
                assert d_pool is not None
                d_pool.view(torch.uint8).fill_(0xA5)
                torch.cuda.synchronize(dev)
                conn.send("poisoned")
            elif cmd[0] == "direct_verify":
                assert d_pool is not None
                s = slots[cmd[1]]
                d_sum = kv_checksum_rows(d_pool, s)
                sha = _sha256_rows(d_pool, s)
                touched = (d_pool.view(torch.uint8) != 0xA5).flatten(3).any(3).any(1).any(0)
                expected = torch.zeros(pool_slots, dtype=torch.bool, device=dev)
                expected[s] = True
                conn.send((d_sum, sha, bool(torch.equal(touched, expected))))
            elif cmd[0] == "scatter":
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
                d_pool = None
                if pool_arena is not None:
                    pool_arena.close()
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
    """P: owns a random pool; gathers and copies into D's arena through the path. With a `direct_write`
    path also maps D's direct-mode pool and writes its rows there with `write_rows`."""
    try:
        from tandem.transfer.checksum import kv_checksum_rows

        torch.cuda.set_device(device)
        dev = torch.device("cuda", device)
        layout = WireLayout.from_dict(layout_d)
        path = make_path(path_name, device, unit)
        _, meta, n_fds, _, pool_meta, n_pool_fds = conn.recv()
        fds = [recv_handle(conn) for _ in range(n_fds)]
        pool_fds = [recv_handle(conn) for _ in range(n_pool_fds)]
        peer = path.open_peer_arena(meta, fds)
        pool_peer = None if pool_meta is None else path.open_peer_arena(pool_meta, pool_fds)
        pool = torch.randn(layout.staging_shape(pool_slots), device=dev).to(layout.dtype)
        storage = path.source_storage(layout, pool_slots)  # the proxy writes only from a registered pool
        if storage is not None:
            pool = storage.copy_(pool)
        slots = slot_sets(pool_slots, n_tokens, P_SEED, dev)
        d_slots = slot_sets(pool_slots, n_tokens, D_SEED, dev)  # D's destination slots, on P's device
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
            elif cmd[0] == "direct":  # the whole direct-mode hand-off, then the sender's checksum
                assert pool_peer is not None
                s, ds, warmup, n = slots[cmd[1]], d_slots[cmd[1]], cmd[2], cmd[3]
                write = functools.partial(path.write_rows, layout, pool, s, pool_peer, ds)
                p_sum = functools.partial(kv_checksum_rows, pool, s)
                # P's view of D's pool must alias the mapping on P's device (a copy would hide the write)
                view = getattr(pool_peer, "pool", lambda _: None)(layout)
                mapped = view is None or (
                    view.device == dev and view.data_ptr() == getattr(pool_peer, "ptr", view.data_ptr())
                )
                for _ in range(warmup):
                    write()
                    p_sum()
                conn.send(
                    {
                        "direct": [_wall_ms(write, dev) for _ in range(n)],
                        "p_checksum": [_wall_ms(p_sum, dev) for _ in range(n)],
                        "dst_chunks": chunks(ds, num_lt),
                        "dst_is_mapping": bool(mapped),
                        "checksum_kernel": bool(kv_cuda.checksum_rows_supported(pool)),
                    }
                )
            elif cmd[0] == "direct_verify":  # one checked transfer (D poisoned its pool first)
                assert pool_peer is not None
                s, ds = slots[cmd[1]], d_slots[cmd[1]]
                checksum = kv_checksum_rows(pool, s)
                rows_ok = checksum == kv_checksum(torch.index_select(pool, 2, s))
                path.write_rows(layout, pool, s, pool_peer, ds)
                conn.send((checksum, _sha256_rows(pool, s), bool(rows_ok)))
            elif cmd[0] == "verify":
                s = slots[cmd[1]]
                staging.view(torch.uint8).fill_(0x5A)
                kv_cuda.gather(pool, s, staging)
                ok = bool(torch.equal(staging, torch.index_select(pool, 2, s)))
                checksum = kv_checksum(staging)
                path.copy_to_peer(staging, peer, 0)
                conn.send((checksum, ok))
            elif cmd[0] == "stop":
                if pool_peer is not None:
                    pool_peer.close()
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
            [sys.executable, "-m", "tandem.transfer.paths.proxy_sidecar", "--unit", unit, "--issue", issue],
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
        for _ in range(export[2] + export[5]):  # fds (region arena, then pool arena): D -> parent -> P
            fd = recv_handle(d)
            send_handle(p, fd, p_proc.pid)
            os.close(fd)
        assert _recv(p) == "ready"
        result: dict[str, Any] = {
            "handle_type": export[3],
            "direct_write": export[4] is not None,
            "cases": {},
        }
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
                **DIRECT_FIELDS,
            }
            print(
                f"  {name} {case}: e2e {med(e2e):.3f} ms, cross {med(st['cross']):.3f} ms, "
                f"verified {result['cases'][case]['verified']}",
                flush=True,
            )
        if result["direct_write"]:  # after the region cases, so a failure here keeps their figures
            try:
                for case in ("unfragmented", "fragmented"):
                    result["cases"][case].update(run_direct(name, case, p, d, args))
            except Exception as exc:
                print(f"  {name} direct FAILED: {exc}", flush=True)
                result["direct_error"] = str(exc)
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


def run_direct(
    name: str, case: str, p: Connection, d: Connection, args: argparse.Namespace
) -> dict[str, Any]:
    """Direct mode for one pool case: P's `write_rows` and checksum, D's checksum, one verified write."""
    p.send(("direct", case, args.warmup, args.iters))
    st = _recv(p)
    d.send(("d_checksum", case, args.warmup, args.iters))
    d_times = _recv(d)
    d.send(("direct_poison",))
    assert _recv(d) == "poisoned"
    p.send(("direct_verify", case))
    p_sum, p_sha, p_rows_ok = _recv(p)
    d.send(("direct_verify", case))
    d_sum, d_sha, d_only_slots = _recv(d)
    checks = {
        "checksum_equal": p_sum == d_sum,
        "rows_equal": p_sha == d_sha,
        "p_rows_checksum_ok": p_rows_ok,
        "d_only_slots_written": d_only_slots,
        "dst_is_mapping": st["dst_is_mapping"],
    }
    out = {
        "direct_ms": med(st["direct"]),
        "direct_samples": st["direct"],
        "direct_dst_chunks": st["dst_chunks"],
        "p_checksum_ms": med(st["p_checksum"]),
        "d_checksum_ms": med(d_times),
        "p_checksum_samples": st["p_checksum"],
        "d_checksum_samples": d_times,
        "checksum_kernel": st["checksum_kernel"],
        "direct_checks": checks,
        "direct_verified": all(checks.values()),
    }
    print(
        f"  {name} {case}: direct {out['direct_ms']:.3f} ms, checksum P {out['p_checksum_ms']:.3f} ms "
        f"D {out['d_checksum_ms']:.3f} ms, verified {out['direct_verified']}"
        + ("" if out["direct_verified"] else f" {checks}"),
        flush=True,
    )
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")
    labels, e2e, cross, direct = [], [], [], []
    for name, res in report["paths"].items():
        for case, c in res.get("cases", {}).items():
            labels.append(f"{name}\n{case[:5]}")
            e2e.append(c["e2e_ms"])
            cross.append(c["cross_ms"])
            direct.append(nan if c.get("direct_ms") is None else c["direct_ms"])
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.27 for x in xs], e2e, 0.27, label="region: gather + cross + scatter")
    ax.bar(list(xs), cross, 0.27, label="region: crossing copy alone")
    ax.bar([x + 0.27 for x in xs], direct, 0.27, label="direct: write_rows (whole hand-off)")
    base = report["baselines"].get("inprocess_p2p_ms")
    if base:
        ax.axhline(base, color="k", ls="--", lw=1, label=f"in-process P2P copy {base:.3f} ms")
    ax.axhline(0.85, color="r", ls=":", lw=1, label="target 0.85 ms")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ms (median)")
    dev = report["device"]
    ax.set_title(f"{report['config']['mib']:.0f} MiB KV hand-off, {dev['name']} x{dev['count']}")
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
    head = ("case", "chunks", "e2e", "cross", "gather", "scatter", "fused", "raw_ipc", "ok")
    rows = [(*head, "direct", "p_csum", "d_csum", "direct_ok")]
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
                    f(c["direct_ms"]),
                    f(c["p_checksum_ms"]),
                    f(c["d_checksum_ms"]),
                    "-" if c["direct_verified"] is None else str(c["direct_verified"]),
                )
            )
            c["cross_vs_inprocess"] = None if not base else base / c["cross_ms"]
            c["e2e_vs_inprocess"] = None if not base else base / c["e2e_ms"]
            c["direct_vs_inprocess"] = None if not base or not c["direct_ms"] else base / c["direct_ms"]
        cases = res.get("cases", {})
        if len(cases) == 2:
            u, fr = cases["unfragmented"], cases["fragmented"]
            res["fragmentation_change_e2e"] = fr["e2e_ms"] / u["e2e_ms"] - 1
            res["fragmentation_change_cross"] = fr["cross_ms"] / u["cross_ms"] - 1
            res["fragmentation_change_direct"] = (
                fr["direct_ms"] / u["direct_ms"] - 1 if fr["direct_ms"] and u["direct_ms"] else None
            )
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
