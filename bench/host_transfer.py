"""`tandem-bench-host-transfer`: the host shared-memory KV hand-off between two real processes.

    tandem-bench-host-transfer --out docs/benchmarks
    tandem-bench-host-transfer --configs qwen3-4b-shape:16 --tokens 2048 --reps 10

What one transfer is here (the engines' path, minus the engines): P is a spawned child process with a
`TransferSender` on the `host_shm` path whose `gather` is `KVPool.gather` from a real CPU pool, the
request's pages handed out in a shuffled order (re-shuffled before every offer, as a long-running pool
fragments). D is this process: a `TransferReceiver` whose receive region lives in a memfd both map, and
a KVPool of its own, also shuffled, into which the verified region is scattered. Per transfer:

    total      D's `request()` -> `poll()` says VERIFIED (stamps: D request, P copy start/end, D DONE
               received, D verified), i.e. PULL + P's gather + P's checksum + the copy into the memfd
               + DONE + D's checksum of the region
    P copy     copy_start -> copy_end as P stamps them (staging alloc, gather, checksum, copy)
    gather     P's `KVPool.gather` alone (timed inside the child)
    D scatter  `KVPool.scatter` of the verified region into D's pages (after `total`)

and, in this process, a plain `copy_` of a contiguous host tensor of the same size into another one
(warm pages) and into a freshly allocated one (first touch, as P's staging buffer is), plus
`kv_checksum` of that many bytes, to show where the time goes. Medians over `--reps` after `--warmup`.
The first warm-up transfer is also checked end to end: D's pool, gathered back, hashes as P's source.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any

import torch

from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import preset
from tandem.bench import util as benchutil
from tandem.transfer import (
    PathOptions,
    Ticket,
    TransferReceiver,
    TransferSender,
    TransferState,
    WireLayout,
    build_path,
    kv_checksum,
)

CTX = mp.get_context("spawn")
PATH = "host_shm"
_DEFAULT_CONFIGS = "tiny:16,qwen3-4b-shape:16,qwen3-4b-shape:1"


def wire_layout(layout: KVLayout) -> WireLayout:
    return WireLayout(
        layout.num_layers, layout.num_kv_heads, layout.head_dim, str(layout.dtype).removeprefix("torch.")
    )


def kv_layout(wire: WireLayout) -> KVLayout:
    return KVLayout(wire.num_layers, wire.num_kv_heads, wire.head_dim, wire.dtype)


def reshuffle(pool: KVPool, rng: random.Random) -> None:
    """Make the next `allocate` hand out the free pages in a random order."""
    free = pool.allocate(pool.num_free_pages)
    rng.shuffle(free)
    pool.free(free)


def make_pool(wire: WireLayout, pool_tokens: int, page_size: int, seed: int) -> KVPool:
    """A CPU pool of `pool_tokens` slots filled with random KV, one layer at a time (bounded temporaries)."""
    pool = KVPool(kv_layout(wire), -(-pool_tokens // page_size), page_size, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for layer in range(wire.num_layers):
        pool.kv[layer].copy_(torch.randn(pool.kv[layer].shape, generator=gen))
    return pool


def p_child(
    unit: str, xdg: str, layout: dict[str, object], pool_tokens: int, page_size: int, seed: int, pipe: Pipe
) -> None:
    """P's process. Commands on `pipe`: ("offer", n_tokens) -> ticket json; ("gather_s", tid) -> float;
    ("stats",) -> dict; ("close",) -> "closed", then the process exits."""
    os.environ["XDG_RUNTIME_DIR"] = xdg
    wire = WireLayout.from_dict(layout)
    pool = make_pool(wire, pool_tokens, page_size, seed)
    rng = random.Random(seed)
    released: queue.SimpleQueue[str] = queue.SimpleQueue()  # filled on the sender's copy worker
    fatal: list[str] = []
    owned: dict[str, list[int]] = {}
    gather_s: dict[str, float] = {}
    sender = TransferSender(
        wire, unit, build_path([], PATH, PathOptions()), released.put, fatal.append, copy_workers=1
    )
    sender.start()
    pipe.send(("ready", sender.instance_id, torch.get_num_threads()))
    while True:
        cmd = pipe.recv()
        while not released.empty():  # the pool is only touched on this thread
            pool.free(owned.pop(released.get()))
        if cmd[0] == "offer":
            n_tokens = int(cmd[1])
            reshuffle(pool, rng)
            pages = pool.allocate(pool.pages_for(n_tokens))
            slots = pool.slots(pages, n_tokens)
            tid_box: list[str] = []

            def gather(out: torch.Tensor, slots: torch.Tensor = slots, box: list[str] = tid_box) -> None:
                t0 = time.perf_counter()
                pool.gather(slots, out)
                gather_s[box[0]] = time.perf_counter() - t0

            ticket = sender.offer(n_tokens, gather, ttl_s=120.0)
            tid_box.append(ticket.transfer_id)  # before D can PULL: the ticket has not left yet
            owned[ticket.transfer_id] = pages
            pipe.send(ticket.to_json())
        elif cmd[0] == "gather_s":
            pipe.send(gather_s.pop(str(cmd[1])))
        elif cmd[0] == "stats":
            stats = {"copies_ok": sender.stats().copies_ok, "fatal": fatal, "pages_owned": len(owned)}
            pipe.send({**stats, "peak_rss_mib": peak_rss_mib()})
        elif cmd[0] == "close":
            sender.close()
            pipe.send("closed")
            return


class ChildP:
    """The parent's handle on `p_child`."""

    def __init__(self, unit: str, xdg: str, wire: WireLayout, pool_tokens: int, page_size: int, seed: int):
        self.pipe, child = CTX.Pipe()
        args = (unit, xdg, wire.to_dict(), pool_tokens, page_size, seed, child)
        self.proc = CTX.Process(target=p_child, args=args, daemon=True)
        self.proc.start()
        _, self.instance, self.threads = self.recv(300.0)

    def recv(self, timeout_s: float = 120.0) -> Any:
        if not self.pipe.poll(timeout_s):
            raise RuntimeError(f"P child did not answer within {timeout_s}s (alive: {self.proc.is_alive()})")
        return self.pipe.recv()

    def call(self, *cmd: object) -> Any:
        self.pipe.send(cmd)
        return self.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.call("close")
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


class Baseline:
    """In-process references over `nbytes`, measured once per transfer (interleaved with them, so a
    machine shared with other work loads both alike): a warm `copy_` between two resident buffers, a
    first-touch `copy_` into a fresh buffer (as P's staging buffer is), and `kv_checksum`."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def measure(self) -> dict[str, float]:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        t1 = time.perf_counter()
        fresh = torch.empty_like(self.src)
        fresh.copy_(self.src)
        t2 = time.perf_counter()
        del fresh
        t3 = time.perf_counter()
        kv_checksum(self.src)
        t4 = time.perf_counter()
        return {
            "memcpy_hot_ms": (t1 - t0) * 1e3,
            "memcpy_cold_ms": (t2 - t1) * 1e3,
            "checksum_ms": (t4 - t3) * 1e3,
        }


def peak_rss_mib() -> float:
    """This process's peak resident set (VmHWM) in MiB; shared memfd pages count in both processes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_config(
    preset_name: str, page_size: int, n_tokens: int, reps: int, warmup: int, seed: int, xdg: str
) -> dict[str, Any]:
    wire = wire_layout(preset(preset_name).kv_layout())
    nbytes = wire.staging_nbytes(n_tokens)
    base = Baseline(nbytes)
    pool_tokens = 2 * n_tokens  # 2x headroom: shuffled pages spread over twice the request's span
    unit = f"bench{os.getpid()}-{preset_name.replace('-', '')[:12]}-{page_size}"
    child = ChildP(unit, xdg, wire, pool_tokens, page_size, seed)
    path = build_path([], PATH, PathOptions())
    arena = -(-nbytes // 4096) * 4096
    receiver = TransferReceiver(wire, unit, arena, path)
    dpool = make_pool(wire, pool_tokens, page_size, seed + 1)
    rng = random.Random(seed + 2)
    rows: list[dict[str, float]] = []
    refs: list[dict[str, float]] = []
    checked = False
    try:
        for i in range(warmup + reps):
            ref = base.measure()
            ticket = Ticket.from_json(child.call("offer", n_tokens))
            reshuffle(dpool, rng)
            pages = dpool.allocate(dpool.pages_for(n_tokens))
            slots = dpool.slots(pages, n_tokens)
            t0 = time.time_ns()
            h = receiver.request(ticket, deadline_s=120.0)
            while (state := receiver.poll(h)) in (TransferState.REQUESTED, TransferState.DONE):
                time.sleep(0.0005)
            if state is not TransferState.VERIFIED:
                raise RuntimeError(f"transfer {i} ended {state.name}: {h.error}")
            received = h.tensor()
            ts = time.perf_counter()
            dpool.scatter(slots, received)
            scatter_s = time.perf_counter() - ts
            if not checked:  # D's pages now hold exactly the verified bytes (= P's gather), layer by layer
                for layer in range(wire.num_layers):
                    got = dpool.kv[layer].index_select(1, slots).view(torch.uint8)
                    if not torch.equal(got, received[layer].view(torch.uint8)):
                        raise RuntimeError(f"D's pool differs from the verified region in layer {layer}")
                checked = True
            del received
            s = h.stamps
            receiver.complete(h)
            dpool.free(pages)
            gather_s = float(child.call("gather_s", ticket.transfer_id))
            if i < warmup:
                continue
            refs.append(ref)
            rows.append(
                {
                    "total_ms": (s.verified_ns - t0) / 1e6,
                    "pull_ms": (s.copy_start_ns - t0) / 1e6,
                    "p_copy_ms": (s.copy_end_ns - s.copy_start_ns) / 1e6,
                    "p_gather_ms": gather_s * 1e3,
                    "done_ms": (s.done_received_ns - s.copy_end_ns) / 1e6,
                    "d_verify_ms": (s.verified_ns - s.done_received_ns) / 1e6,
                    "d_scatter_ms": scatter_s * 1e3,
                }
            )
        rstats, pstats = receiver.stats(), child.call("stats")
    finally:
        receiver.close()
        child.close()
    del base
    med = {k: benchutil.median([r[k] for r in rows]) for k in rows[0]}
    ref_med = {k: benchutil.median([r[k] for r in refs]) for k in refs[0]}
    gbs = nbytes / 1e9
    return {
        "preset": preset_name,
        "dtype": wire.dtype_name,
        "page_size": page_size,
        "tokens": n_tokens,
        "bytes": nbytes,
        "token_bytes": wire.token_bytes,
        "source_chunks": wire.num_layers * 2 * -(-n_tokens // page_size),
        "pool_tokens": pool_tokens,
        "reps": reps,
        "warmup": warmup,
        "p_threads": child.threads,
        "median": med,
        "min_total_ms": min(r["total_ms"] for r in rows),
        "max_total_ms": max(r["total_ms"] for r in rows),
        "baseline": ref_med,
        "gbps": {
            "total": gbs / (med["total_ms"] / 1e3),
            "p_copy": gbs / (med["p_copy_ms"] / 1e3),
            "memcpy_hot": gbs / (ref_med["memcpy_hot_ms"] / 1e3),
            "memcpy_cold": gbs / (ref_med["memcpy_cold_ms"] / 1e3),
        },
        "speed_vs_memcpy": {  # > 1 would be faster than the plain copy
            "total": ref_med["memcpy_hot_ms"] / med["total_ms"],
            "p_copy": ref_med["memcpy_hot_ms"] / med["p_copy_ms"],
        },
        "verified": rstats.verify_ok,
        "mismatches": rstats.verify_mismatch,
        "failed": rstats.transfers_failed,
        "p_copies_ok": pstats["copies_ok"],
        "p_fatal": pstats["fatal"],
        "arena_leak_bytes": rstats.arena_bytes - rstats.free_bytes,
        "end_to_end_checked": checked,
        "peak_rss_mib": {"d": peak_rss_mib(), "p": pstats["peak_rss_mib"]},
        "raw": rows,
        "raw_baseline": refs,
    }


_STAGES = (
    ("pull_ms", "PULL -> copy start"),
    ("p_gather_ms", "P gather"),
    ("p_rest_ms", "P alloc+checksum+copy"),
    ("done_ms", "copy end -> DONE"),
    ("d_verify_ms", "D verify"),
    ("d_scatter_ms", "D scatter"),
)


def _label(r: dict[str, Any]) -> str:
    return f"{r['preset']} p{r['page_size']}\n{r['bytes'] / 2**20:.0f} MiB"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = benchutil.pyplot()
    if plt is None:
        return
    meta, runs = result["meta"], result["results"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 4.4), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        med = dict(r["median"])
        med["p_rest_ms"] = max(0.0, med["p_copy_ms"] - med["p_gather_ms"])
        bottom = 0.0
        for key, name in _STAGES:
            ax.bar(0, med[key], bottom=bottom, label=name, width=0.6)
            bottom += med[key]
        base = r["baseline"]
        ax.bar(1, base["memcpy_hot_ms"], width=0.6, color="grey", label="memcpy (warm)")
        ax.bar(2, base["memcpy_cold_ms"], width=0.6, color="silver", label="memcpy (first touch)")
        ax.bar(3, base["checksum_ms"], width=0.6, color="tan", label="kv_checksum")
        ax.set_xticks(
            [0, 1, 2, 3], labels=["transfer\n+ scatter", "memcpy\nwarm", "memcpy\ncold", "checksum"]
        )
        ax.set_ylabel("ms (median)")
        ax.set_title(_label(r).replace("\n", ", "), fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    benchutil.save_figure(
        plt,
        fig,
        path,
        f"host_shm KV hand-off, P process -> D process, on {meta['device']} (commit {meta['commit'][:10]})",
    )


def print_table(result: dict[str, Any]) -> None:
    meta = result["meta"]
    print(f"\nhost_shm hand-off on {meta['device']}, commit {meta['commit']}, torch {meta['torch']}\n")
    rows = []
    for r in result["results"]:
        m, b, g = r["median"], r["baseline"], r["gbps"]
        rows.append(
            [
                r["preset"],
                r["page_size"],
                f"{r['bytes'] / 2**20:.1f}",
                r["reps"],
                m["total_ms"],
                m["p_copy_ms"],
                m["p_gather_ms"],
                m["d_verify_ms"],
                m["d_scatter_ms"],
                b["memcpy_hot_ms"],
                b["memcpy_cold_ms"],
                g["total"],
                g["memcpy_hot"],
                r["speed_vs_memcpy"]["total"],
            ]
        )
    print(
        benchutil.format_table(
            [
                "layout",
                "page",
                "MiB",
                "n",
                "total ms",
                "P copy ms",
                "gather ms",
                "D verify ms",
                "D scatter ms",
                "memcpy ms",
                "memcpy cold ms",
                "total GB/s",
                "memcpy GB/s",
                "memcpy/total",
            ],
            rows,
        )
    )


def _configs(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, page = item.strip().partition(":")
        out.append((name, int(page or 16)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem-bench-host-transfer", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--configs",
        type=_configs,
        default=_configs(_DEFAULT_CONFIGS),
        help=f"comma list of preset:page_size (default {_DEFAULT_CONFIGS})",
    )
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per transfer")
    ap.add_argument("--reps", type=int, help="timed transfers per config (default: 50 tiny, 10 others)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for <name>.json and <name>.png")
    ap.add_argument("--name", default="host-transfer-cpu", help="file stem")
    ap.add_argument("--replot", type=Path, help="only redraw the PNG of an existing result JSON")
    args = ap.parse_args(argv)

    if args.replot is not None:
        result = benchutil.read_json(args.replot)
        plot(result, benchutil.png_beside(args.replot))
        print_table(result)
        return 0

    results = []
    load_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as xdg:
        os.environ["XDG_RUNTIME_DIR"] = xdg  # the receiver's control dir; the child sets the same
        for name, page in args.configs:
            reps = args.reps if args.reps is not None else (50 if name == "tiny" else 10)
            t0 = time.perf_counter()
            results.append(run_config(name, page, args.tokens, reps, args.warmup, args.seed, xdg))
            r = results[-1]
            print(
                f"  {name} page {page}: total {r['median']['total_ms']:.2f} ms "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    meta = {
        **benchutil.provenance(torch.device("cpu"), "tandem-bench-host-transfer", argv),
        "benchmark": "host_transfer",
        "path": PATH,
        "torch_threads_d": torch.get_num_threads(),
        "timer": "time.time_ns stamps (cross-process) and perf_counter",
        "loadavg_start": load_start,
        "loadavg_end": list(os.getloadavg()),
    }
    result = {"meta": meta, "results": results}
    benchutil.write_json(args.out / f"{args.name}.json", result)
    plot(result, args.out / f"{args.name}.png")
    print_table(result)
    print(f"\nwrote {args.out / args.name}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
