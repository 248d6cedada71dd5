"""The TCP path: round trip, the receiver's drop rule (its own proof), authentication, epochs.

Drives the path and D's `TcpArena` directly, doing what the receiver does: `expect(region, tid)`
before the PULL, `forget(region)` before the region is freed or reused.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.transfer import PATHS, RegionAllocator, TransferError, WireLayout, kv_checksum, select_path
from tandem.transfer.tcp_path import SECRET_NAME, TcpArena, TcpPath, TcpPeerArena

LAYOUT = WireLayout(2, 2, 16, "float32")  # 512 bytes per token


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    return run


@pytest.fixture
def path() -> TcpPath:
    return TcpPath(chunk_bytes=8192)  # several chunks per transfer


@pytest.fixture
def arena(path: TcpPath) -> Iterator[TcpArena]:
    a = path.create_arena(1 << 20, "ut-0123abcd")
    yield a
    a.close()


def staged(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.staging_shape(n_tokens), generator=g)


def test_registered_and_probe_works() -> None:
    assert "tcp" in PATHS
    assert select_path(["tcp"], require="tcp").name == "tcp"


def test_round_trip(path: TcpPath, arena: TcpArena) -> None:
    alloc = RegionAllocator(arena.nbytes)
    peer = path.open_peer_arena(arena.export().meta, [])
    for seed, n_tokens in enumerate((1, 37, 300)):
        x = staged(n_tokens, seed)
        region = alloc.allocate(LAYOUT.staging_nbytes(n_tokens))
        assert region is not None
        tid = secrets.token_hex(16)
        arena.expect(region, tid)
        path.copy_to_peer(x, peer, region.offset, tid=tid)
        assert kv_checksum(arena.region_bytes(region)) == kv_checksum(x)
        arena.forget(region)
        alloc.free(region)
    st = arena.stats()
    assert st.chunks_dropped == 0 and st.expected == 0 and st.chunks_written >= 20


def test_late_chunks_dropped_after_abort_and_region_reuse(path: TcpPath, arena: TcpArena) -> None:
    """D gave up on A and freed its region at once (forget is the proof); B now owns the range. A's
    late copy must not touch it: every chunk is dropped and P hears DROPPED."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(100))
    assert region is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid_a, tid_b = secrets.token_hex(16), secrets.token_hex(16)
    arena.expect(region, tid_a)
    arena.forget(region)  # A failed on D: from here no byte of A may land
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(100, 1), peer, region.offset, tid=tid_a)
    assert not arena.region_bytes(region).any()
    b = staged(100, 2)
    arena.expect(region, tid_b)
    with pytest.raises(TransferError, match="dropped"):  # A again, now into B's range
        path.copy_to_peer(staged(100, 1), peer, region.offset, tid=tid_a)
    path.copy_to_peer(b, peer, region.offset, tid=tid_b)
    assert kv_checksum(arena.region_bytes(region)) == kv_checksum(b)
    assert arena.stats().chunks_dropped >= 2 * (LAYOUT.staging_nbytes(100) // path.chunk_bytes)


def test_chunk_outside_the_expected_range_is_dropped(path: TcpPath, arena: TcpArena) -> None:
    alloc = RegionAllocator(arena.nbytes)
    small = alloc.allocate(LAYOUT.staging_nbytes(10))
    assert small is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid = secrets.token_hex(16)
    arena.expect(small, tid)
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(40, 3), peer, small.offset, tid=tid)  # overruns its region
    assert not arena.region_bytes(small).any()


def test_wrong_secret_is_refused(path: TcpPath, arena: TcpArena, tmp_path: Path) -> None:
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(20))
    assert region is not None
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    other = tmp_path / "other.secret"
    other.write_bytes(os.urandom(32))
    meta = dict(arena.export().meta, secret_path=str(other))
    peer = path.open_peer_arena(meta, [])
    with pytest.raises(TransferError):
        path.copy_to_peer(staged(20, 4), peer, region.offset, tid=tid)
    assert arena.stats().auth_failures == 1
    assert not arena.region_bytes(region).any()


def test_unauthenticated_writer_cannot_write(arena: TcpArena) -> None:
    """A raw client that skips the handshake gets disconnected before any chunk is read."""
    with socket.create_connection((arena.host, arena.port), timeout=2) as s:
        s.recv(36)
        s.sendall(b"\0" * 64 + b"\1" * 200)
        s.settimeout(2)
        with contextlib.suppress(ConnectionResetError):  # a reset: closed with our bytes unread
            assert s.recv(100) == b""  # closed
    assert arena.stats().chunks_written == 0


def test_epoch_mismatch_is_dropped(path: TcpPath, arena: TcpArena) -> None:
    """Chunks addressed to another incarnation of D (a stale epoch) never land."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(20))
    assert region is not None
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    peer = path.open_peer_arena(arena.export().meta, [])
    assert isinstance(peer, TcpPeerArena)
    peer.epoch = os.urandom(16)
    with pytest.raises(TransferError, match="dropped"):
        path.copy_to_peer(staged(20, 5), peer, region.offset, tid=tid)
    assert not arena.region_bytes(region).any()
    assert arena.stats().chunks_dropped >= 1


def test_copy_without_transfer_id_is_refused(path: TcpPath, arena: TcpArena) -> None:
    peer = path.open_peer_arena(arena.export().meta, [])
    with pytest.raises(TransferError, match="transfer id"):
        path.copy_to_peer(staged(4, 6), peer, 0)


def test_forget_waits_for_a_chunk_in_progress(path: TcpPath, arena: TcpArena) -> None:
    """Many copies race `forget`: whatever landed landed before it returned; nothing after."""
    region = RegionAllocator(arena.nbytes).allocate(LAYOUT.staging_nbytes(1000))
    assert region is not None
    peer = path.open_peer_arena(arena.export().meta, [])
    tid = secrets.token_hex(16)
    arena.expect(region, tid)
    errors: list[BaseException] = []

    def copy() -> None:
        try:
            path.copy_to_peer(staged(1000, 7), peer, region.offset, tid=tid)
        except TransferError as exc:
            errors.append(exc)

    t = threading.Thread(target=copy)
    t.start()
    arena.forget(region)
    snapshot = arena.region_bytes(region).clone()
    t.join(10)
    assert torch.equal(snapshot, arena.region_bytes(region))  # no write after forget returned


def test_secret_file_is_private(arena: TcpArena) -> None:
    st = os.stat(arena.secret_path)
    assert arena.secret_path.name == SECRET_NAME and st.st_mode & 0o777 == 0o600 and st.st_size == 32
