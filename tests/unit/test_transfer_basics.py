"""Pure pieces of tandem.transfer: checksum, layout, ticket, frames, allocator, control dir, paths."""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path

import pytest
import torch

from tandem.transfer import (
    PathUnavailable,
    ProtocolError,
    RegionAllocator,
    Ticket,
    UnsafeControlDir,
    WireLayout,
    control_dir,
    kv_checksum,
    select_path,
)
from tandem.transfer.frames import FrameReader, MsgType, decode, encode
from tandem.transfer.paths.host_shm import HostShmPath
from tests.support.transfer_fakes import FailingPath


@pytest.fixture
def xdg(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("x"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    return d


def test_checksum_equal_bytes_equal_sum() -> None:
    x = torch.randn(3, 2, 17, 4, 8).to(torch.bfloat16)
    assert kv_checksum(x) == kv_checksum(x.clone())
    # Same bytes, different dtype/shape: the checksum is over raw bytes.
    assert kv_checksum(x) == kv_checksum(x.view(torch.int16).reshape(-1))


def test_checksum_detects_flipped_byte_anywhere() -> None:
    x = torch.randn(2, 2, 33, 2, 8)
    base = kv_checksum(x)
    flat = x.view(-1).view(torch.uint8)
    for pos in (0, 1, 7, 8, flat.numel() // 2, flat.numel() - 1):
        y = x.clone()
        y.view(-1).view(torch.uint8)[pos] ^= 0x10
        assert kv_checksum(y) != base, pos


def test_checksum_detects_swapped_rows_including_mirror_rows() -> None:
    rows = torch.randn(16, 64)
    swapped = rows.clone()
    swapped[[3, 9]] = rows[[9, 3]]
    assert kv_checksum(rows) != kv_checksum(swapped)
    # Mirror-image rows defeat a linear position weight (Σ(i+1)·w); the hashed weight catches them.
    a, b = 0x1234, 0x7777
    mirror = torch.tensor([[a, b], [b, a]], dtype=torch.int64)
    assert kv_checksum(mirror) != kv_checksum(mirror.flip(0).contiguous())


def test_checksum_tail_padding_and_length() -> None:
    assert kv_checksum(torch.zeros(13, dtype=torch.uint8)) != kv_checksum(torch.zeros(16, dtype=torch.uint8))
    odd = torch.arange(21, dtype=torch.uint8)
    assert kv_checksum(odd) == kv_checksum(odd.clone())
    shifted = torch.arange(24, dtype=torch.uint8)[3:]  # unaligned storage offset
    assert kv_checksum(shifted) == kv_checksum(shifted.clone())


def test_checksum_across_chunks_positions_matter(monkeypatch: pytest.MonkeyPatch) -> None:
    import tandem.transfer.checksum as ck

    monkeypatch.setattr(ck, "_CHUNK_WORDS", 64)
    monkeypatch.setattr(ck, "_weights_cache", {})
    x = torch.randn(1024, dtype=torch.float64)
    y = x.clone()
    y[[10, 10 + 64]] = x[[10 + 64, 10]]  # same offset in two chunks
    assert kv_checksum(x) != kv_checksum(y)


def _reference_checksum(data: bytes, chunk_words: int) -> int:
    """The checksum module's definition, word by word in Python integers (slow; small inputs only)."""
    mask = (1 << 64) - 1

    def fmix(k: int) -> int:
        k ^= k >> 33
        k = (k * 0xFF51AFD7ED558CCD) & mask
        k ^= k >> 33
        k = (k * 0xC4CEB9FE1A85EC53) & mask
        return k ^ (k >> 33)

    def h(j: int) -> int:
        x = ((j + 1) * 0x9E3779B97F4A7C15) & mask
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return (x ^ (x >> 31)) | 1

    padded = data + bytes(-len(data) % 8)
    a = b = 0
    for i in range(len(padded) // 8):
        w = int.from_bytes(padded[8 * i : 8 * i + 8], "little")
        chunk, j = divmod(i, chunk_words)
        a = (a + w) & mask
        b = (b + h(j) * (fmix(chunk + 0x5BD1E995) | 1) * w) & mask
    return fmix(a ^ fmix(b ^ len(data)))


@pytest.mark.parametrize("nbytes", [5, 8, 64 * 8, 64 * 8 + 3, 3 * 64 * 8, 7 * 64 * 8 + 24, 11 * 64 * 8])
def test_checksum_matches_its_definition_across_groups_and_tail(
    monkeypatch: pytest.MonkeyPatch, nbytes: int
) -> None:
    """Chunks are hashed several at a time (`_GROUP`); whole groups, a partial group, a tail chunk and
    a sub-word tail must all give the word-by-word definition's value."""
    import tandem.transfer.checksum as ck

    monkeypatch.setattr(ck, "_CHUNK_WORDS", 64)
    monkeypatch.setattr(ck, "_GROUP", 3)
    monkeypatch.setattr(ck, "_weights_cache", {})
    gen = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    assert kv_checksum(data) == _reference_checksum(data.numpy().tobytes(), 64)


def test_layout_and_ticket_roundtrip() -> None:
    lay = WireLayout(4, 2, 64, "bfloat16")
    assert lay.staging_shape(5) == (4, 2, 5, 2, 64)
    assert lay.token_bytes == 4 * 2 * 2 * 64 * 2
    assert WireLayout.from_dict(lay.to_dict()) == lay
    assert lay.fingerprint() != WireLayout(4, 2, 64, "float16").fingerprint()
    t = Ticket(
        "a" * 32, "/x/p.sock", "/x/p.lock", "b" * 32, 5, lay.staging_nbytes(5), lay.fingerprint(), "host_shm"
    )
    assert Ticket.from_json(t.to_json()) == t
    with pytest.raises(ValueError):
        Ticket.from_json('{"transfer_id": "zz"}')
    with pytest.raises(ValueError):
        WireLayout(0, 1, 1, "float32")


def test_frames_roundtrip_and_rejects_malformed() -> None:
    frame = encode(MsgType.PULL, tid="a" * 32, offset=4096, nbytes=10, remaining_ms=5.5)
    kind, msg = decode(frame[4:])
    assert kind is MsgType.PULL and msg["offset"] == 4096
    for body in (
        b"\xff\xfe",
        b"[1]",
        b'{"type": 99}',
        b'{"type": 3, "tid": "x"}',
        b'{"type": true}',
        b'{"type": 6, "tid": 5}',
    ):
        with pytest.raises(ProtocolError):
            decode(body)
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 1 << 30))
    with pytest.raises(ProtocolError):
        FrameReader(b).read()
    a.close()
    b.close()


def test_frames_pass_fds() -> None:
    from tandem.transfer.frames import send_frame

    a, b = socket.socketpair()
    r, w = os.pipe()
    hello = encode(MsgType.HELLO, v=1, layout={}, layout_fp="x", path="p", arena={}, d_instance="d")
    send_frame(a, hello, (w,))
    kind, _msg, fds = FrameReader(b).read()
    assert kind is MsgType.HELLO and len(fds) == 1
    os.write(fds[0], b"hi")
    assert os.read(r, 2) == b"hi"
    for fd in (r, w, *fds):
        os.close(fd)
    a.close()
    b.close()


def test_allocator_first_fit_alignment_and_coalescing() -> None:
    al = RegionAllocator(16 * 4096)
    a = al.allocate(1)
    b = al.allocate(5000)
    c = al.allocate(4096)
    assert a is not None and b is not None and c is not None
    assert (a.offset, b.offset, c.offset) == (0, 4096, 3 * 4096) and b.alloc_bytes == 8192
    al.free(b)
    d = al.allocate(4096)
    assert d is not None and d.offset == 4096  # first fit reuses the hole
    assert al.allocate(100 * 4096) is None
    for r in (a, c, d):
        al.free(r)
    assert al.free_bytes == al.capacity and al.live_count == 0
    assert al.allocate(16 * 4096) is not None  # fully coalesced
    with pytest.raises(AssertionError):
        al.free(a)


def test_control_dir_created_private(xdg: str) -> None:
    d = control_dir("unit-a")
    assert d.parent == type(d)(xdg) and (os.stat(d).st_mode & 0o777) == 0o700
    assert control_dir("unit-a") == d


def test_control_dir_refuses_bad_permissions(xdg: str) -> None:
    bad = os.path.join(xdg, f"tandem-{os.getuid()}-loose")
    os.mkdir(bad, 0o755)
    os.chmod(bad, 0o755)
    with pytest.raises(UnsafeControlDir):
        control_dir("loose")
    os.symlink("/tmp", os.path.join(xdg, f"tandem-{os.getuid()}-link"))
    with pytest.raises(UnsafeControlDir):
        control_dir("link")
    with pytest.raises(ValueError):
        control_dir("../escape")


def test_select_path_require_never_falls_back() -> None:
    registry = {"failing": FailingPath, "host_shm": HostShmPath}
    with pytest.raises(PathUnavailable):
        select_path(["failing", "host_shm"], require="failing", registry=registry)
    assert select_path(["failing", "host_shm"], None, registry=registry).name == "host_shm"
    assert select_path([], require="host_shm", registry=registry).name == "host_shm"
    with pytest.raises(PathUnavailable):
        select_path(["failing"], None, registry=registry)
    with pytest.raises(PathUnavailable):
        select_path(["nope"], require="nope", registry=registry)


def test_checksum_bench_writes_equal_checksums_for_every_grouping(tmp_path: Path) -> None:
    from tandem.bench import checksum as bench_checksum

    assert bench_checksum.main(["--mib", "9", "--reps", "1", "--groups", "1,2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "checksum.json").read_text())
    runs = [(r["group"], r["busy"]) for r in result["results"]]
    assert runs == [(1, False), (1, True), (2, False), (2, True)]
    assert all(r["n"] == 1 and r["median_ms"] > 0 for r in result["results"])
    assert result["meta"]["mib"] == 9
