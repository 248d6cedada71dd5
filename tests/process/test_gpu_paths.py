"""GPU transfer paths (cuda_ipc, cuda_vmm, proxy): probes, a cross-process protocol round trip with
checksum verification, stale handles and bad registrations. Skipped on the CPU, except the checks that
need no device (registry, refusals before any CUDA call, probes failing with a reason)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import torch

from tandem.csrc import kv_cuda
from tandem.transfer import (
    PathUnavailable,
    Ticket,
    TransferError,
    TransferPath,
    TransferReceiver,
    TransferSender,
    TransferState,
    WireLayout,
)
from tandem.transfer.paths.cuda import CudaIpcPath, CudaVmmPath
from tandem.transfer.paths.proxy import ProxyPath
from tandem.transfer.paths.proxy_sidecar import ProxyClient
from tandem.transfer.paths.registry import NAMES, path_factories
from tests.support.transfer_fakes import fake_kv, fake_pool

LAYOUT = WireLayout(4, 2, 64, "bfloat16")
CTX = mp.get_context("spawn")
GPU_PATHS = ["cuda_ipc", "cuda_vmm", "proxy"]


def _need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if kv_cuda.module() is None:
        pytest.skip(kv_cuda.build_info())


def _devices() -> tuple[int, int]:
    """(P's device, D's device): two GPUs when there are two, else one for both."""
    return (0, 1) if torch.cuda.device_count() > 1 else (0, 0)


def make(name: str, device: int, unit: str) -> TransferPath:
    if name == "cuda_ipc":
        return CudaIpcPath(device)
    if name == "cuda_vmm":
        return CudaVmmPath(device)
    return ProxyPath(unit=unit, device=device, layout=LAYOUT, direct=True)  # region and direct both tested


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("x"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    return d


@pytest.fixture
def proxy(xdg: str) -> Iterator[str]:
    _need_cuda()
    unit = f"px{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.transfer.paths.proxy_sidecar", "--unit", unit],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "ready" in line, f"proxy did not start: {line!r}"
    yield unit
    proc.terminate()
    proc.wait(30)


def sender_child(
    name: str, device: int, unit: str, xdg: str, seeds: list[int], n_tokens: int, conn: Connection
) -> None:
    """P in its own process: offers one transfer per seed, gathers fake KV on its GPU."""
    os.environ["XDG_RUNTIME_DIR"] = xdg
    torch.cuda.set_device(device)
    path = make(name, device, unit)
    sender = TransferSender(LAYOUT, unit, path, lambda tid: None, lambda reason: None, slot="gpu0")
    sender.start()
    tickets = []
    for seed in seeds:
        pool, slots = (t.to(f"cuda:{device}") for t in fake_pool(LAYOUT, n_tokens, seed))
        storage = path.source_storage(LAYOUT, pool.shape[2])  # the proxy must know P's pool up front
        if storage is not None:
            pool = storage.copy_(pool)

        def gather(out: torch.Tensor, p: torch.Tensor = pool, s: torch.Tensor = slots) -> None:
            out.copy_(p.index_select(2, s))

        tickets.append(sender.offer(n_tokens, gather, ttl_s=60.0, rows=(pool, slots)).to_json())
    conn.send(tickets)
    conn.recv()  # parent says stop
    sender.close()
    conn.send("closed")


# ---- CPU-safe -----------------------------------------------------------------------------------------


def test_the_registry_builds_every_path_by_its_name_without_touching_cuda() -> None:
    reg = path_factories()
    assert set(reg) == set(NAMES) and set(GPU_PATHS) <= set(reg)
    assert all(reg[n]().name == n for n in NAMES)


@pytest.mark.parametrize("cls", [CudaIpcPath, CudaVmmPath])
def test_probe_fails_with_a_reason_without_cuda(cls: type[TransferPath]) -> None:
    if torch.cuda.is_available() and kv_cuda.module() is not None:
        pytest.skip("CUDA present: the probe may succeed")
    with pytest.raises(PathUnavailable, match=r"CUDA not available|not built"):
        cls(0).probe()


def test_wrong_arena_kind_is_refused_and_fds_closed() -> None:
    r, w = os.pipe()
    with pytest.raises(TransferError, match="expects a cuda_ipc arena"):
        CudaIpcPath(0).open_peer_arena({"kind": "memfd", "nbytes": 4096}, [r])
    with pytest.raises(OSError):
        os.fstat(r)  # the path took ownership of the fd and closed it
    os.close(w)
    with pytest.raises(TransferError, match="expects a cuda_vmm arena"):
        CudaVmmPath(0).open_peer_arena({"kind": "cuda_ipc", "nbytes": 1}, [])


def test_own_ipc_handle_is_refused() -> None:
    meta = {"kind": "cuda_ipc", "nbytes": 64, "pid": os.getpid(), "handle": "00" * 64}
    with pytest.raises(TransferError, match="this process"):
        CudaIpcPath(0).open_peer_arena(meta, [])


# ---- GPU ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cuda_ipc", "cuda_vmm"])
def test_probe_moves_real_bytes_fast(name: str) -> None:
    _need_cuda()
    path = make(name, 0, "unused")
    path.probe()
    assert path.probe_gbps is not None and path.probe_gbps > 50  # type: ignore[attr-defined]
    if isinstance(path, CudaVmmPath):
        assert path.handle_type in ("fabric", "posix_fd")


@pytest.mark.gpu
def test_proxy_probe(proxy: str) -> None:
    path = ProxyPath(unit=proxy, device=0, layout=LAYOUT)
    path.probe()
    assert path.probe_gbps is not None


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_PATHS)
def test_cross_process_round_trip_verified(name: str, xdg: str, request: pytest.FixtureRequest) -> None:
    _need_cuda()
    unit = request.getfixturevalue("proxy") if name == "proxy" else f"u{os.getpid()}"
    p_dev, d_dev = _devices()
    torch.cuda.set_device(d_dev)
    seeds, n_tokens = [1, 2, 3, 4, 5], 300
    parent, child = CTX.Pipe()
    proc = CTX.Process(
        target=sender_child, args=(name, p_dev, unit, xdg, seeds, n_tokens, child), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(120), "P child did not start"
        tickets = [Ticket.from_json(t) for t in parent.recv()]
        rx = TransferReceiver(LAYOUT, unit, 1 << 24, make(name, d_dev, unit))
        try:
            for seed, ticket in zip(seeds, tickets, strict=True):
                h = rx.request(ticket, deadline_s=60.0)
                end = time.monotonic() + 60
                while rx.poll(h) in (TransferState.REQUESTED, TransferState.DONE) and time.monotonic() < end:
                    time.sleep(0.002)
                assert rx.poll(h) is TransferState.VERIFIED, h.error
                got = h.tensor()
                assert got.device.type == "cuda"
                want = fake_kv(LAYOUT, n_tokens, seed).to(got.device)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                rx.complete(h)
            stats = rx.stats()
            assert stats.verify_ok == len(seeds) and stats.verify_mismatch == 0
            assert stats.free_bytes == stats.arena_bytes  # no leaked region
        finally:
            rx.close()
        parent.send("stop")
        assert parent.poll(60) and parent.recv() == "closed"
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_PATHS)
def test_cross_process_direct_write_into_fragmented_pool(
    name: str, xdg: str, request: pytest.FixtureRequest
) -> None:
    """Direct mode on a GPU: the fused kernel (P's, or the sidecar's on the proxy path) writes P's
    (shuffled) pool rows straight into D's pool at D's (shuffled) slots; D verifies in place; nothing
    else is written."""
    _need_cuda()
    unit = request.getfixturevalue("proxy") if name == "proxy" else f"d{os.getpid()}"
    p_dev, d_dev = _devices()
    torch.cuda.set_device(d_dev)
    seeds, n_tokens, pool_slots = [11, 12, 13], 300, 2048
    parent, child = CTX.Pipe()
    proc = CTX.Process(
        target=sender_child, args=(name, p_dev, unit, xdg, seeds, n_tokens, child), daemon=True
    )
    proc.start()
    try:
        assert parent.poll(120), "P child did not start"
        tickets = [Ticket.from_json(t) for t in parent.recv()]
        rx = TransferReceiver(
            LAYOUT, unit, pool_slots * LAYOUT.token_bytes, make(name, d_dev, unit), direct=True
        )
        try:
            pool = rx.pool_view()
            assert pool.device == torch.device("cuda", d_dev)
            pool.zero_()
            order = torch.randperm(pool_slots, generator=torch.Generator().manual_seed(3))
            for i, (seed, ticket) in enumerate(zip(seeds, tickets, strict=True)):
                dest = order[i * n_tokens : (i + 1) * n_tokens].numpy().astype("int64")
                h = rx.request(ticket, 60.0, dest, lambda: None)
                end = time.monotonic() + 60
                while rx.poll(h) in (TransferState.REQUESTED, TransferState.DONE) and time.monotonic() < end:
                    time.sleep(0.002)
                assert rx.poll(h) is TransferState.VERIFIED, h.error
                got = pool.index_select(2, torch.from_numpy(dest).to(pool.device))
                want = fake_kv(LAYOUT, n_tokens, seed).to(pool.device)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                rx.complete(h)
            untouched = order[len(seeds) * n_tokens :].to(pool.device)
            assert not pool.index_select(2, untouched).view(torch.uint8).any()  # no stray write
            stats = rx.stats()
            assert stats.verify_ok == len(seeds) and stats.verify_mismatch == 0
        finally:
            rx.close()
        parent.send("stop")
        assert parent.poll(60) and parent.recv() == "closed"
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _export_and_exit(device: int, conn: Connection) -> None:
    torch.cuda.set_device(device)
    arena = CudaIpcPath(device).create_arena(1 << 20, "stale")
    conn.send(arena.export().meta)
    arena.close()


@pytest.mark.gpu
def test_handle_from_a_dead_process_is_a_clear_error() -> None:
    _need_cuda()
    p_dev, d_dev = _devices()
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=_export_and_exit, args=(d_dev, child), daemon=True)
    proc.start()
    assert parent.poll(120)
    meta = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    with pytest.raises(TransferError, match="cannot open D's IPC handle"):
        CudaIpcPath(p_dev).open_peer_arena(meta, [])


@pytest.mark.gpu
def test_proxy_refuses_mismatched_layout_and_unknown_arena(proxy: str) -> None:
    ok = ProxyPath(unit=proxy, device=0, layout=LAYOUT)
    ok.alloc_staging(LAYOUT, 8)  # registers this unit's layout with the proxy
    other = WireLayout(4, 2, 64, "float16")
    bad = ProxyPath(unit=proxy, device=0, layout=other)
    with pytest.raises(TransferError, match="layout mismatch"):
        bad.alloc_staging(other, 8)
    client = ProxyClient(ok.socket_path)
    with pytest.raises(TransferError, match="unknown staging registration"):
        client.request(op="copy", src="nope", src_offset=0, dst="nope", dst_offset=0, nbytes=16)
    client.close()
    ok.close()


@pytest.mark.gpu
def test_staging_must_be_on_the_path_device() -> None:
    _need_cuda()
    from tandem.transfer.paths.cuda import MappedPeer

    with pytest.raises(TransferError, match="staging must be on cuda:0"):
        CudaIpcPath(0).copy_to_peer(torch.zeros(16), MappedPeer(0, 16, 0, lambda: None, "fake"), 0)
