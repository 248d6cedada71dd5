"""The device carry (bench/device/make_carry.sh, `tandem.bench.carry`): every module the stubs, the
engine workers and the benches import resolves from the carry and the GPU machine's own packages.
The built carry's check is skipped where `.carry/carry.tar.xz` was not built (it is git-ignored)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tandem.bench.carry import ROOT, check, entry_files, external_imports

TARBALL = ROOT / ".carry" / "carry.tar.xz"


def test_the_walk_reaches_the_stubs_workers_and_benches_imports() -> None:
    """What the device entries import besides tandem: the stubs' channel (msgspec), the client
    (tritonclient, pysbd through the gateway's client library), the codec (snac), and not PyAV,
    whose only server-side user (the `voices` model) the device scripts leave out."""
    entries = {str(p.relative_to(ROOT)) for p in entry_files()}
    assert "model_repository/decode/1/model.py" in entries
    assert "model_repository/voices/1/model.py" not in entries
    names = external_imports()
    for needed in ("msgspec", "tritonclient", "pysbd", "snac", "tokenizers", "tenacity", "numpy", "torch"):
        assert needed in names, needed
    assert "av" not in names
    assert "setproctitle" not in names  # imported under `except ImportError`: optional


def test_a_site_without_a_module_or_with_the_wrong_abi_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    missing = {m.name: m.needed_by for m in check(site)}
    assert "import msgspec" in (ROOT / missing["msgspec"]).read_text()  # named by a module that imports it
    assert "tritonclient" in missing and "torch" not in missing  # the device has torch
    (site / "msgspec").mkdir()
    (site / "pysbd.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")  # built for this machine's 3.11
    missing = {m.name for m in check(site)}
    assert "msgspec" not in missing and "pysbd" in missing
    (site / "pysbd.cpython-312-x86_64-linux-gnu.so").write_bytes(b"")
    assert "pysbd" not in {m.name for m in check(site)}


def test_a_carried_distributions_requirements_must_be_carried(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "tritonclient-2.73.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Name: tritonclient\nRequires-Dist: numpy>=1.19.1\nRequires-Dist: grpcio>=1.81; extra == 'grpc'\n"
        "Requires-Dist: aiohttp<4; extra == 'all'\n"
    )
    needs = {(m.name, m.needed_by) for m in check(site) if m.needed_by.startswith("trit")}
    assert needs == {("numpy", "tritonclient"), ("grpcio", "tritonclient")}  # not the `all` extra


@pytest.mark.skipif(not TARBALL.is_file(), reason="no .carry/carry.tar.xz (bench/device/make_carry.sh)")
def test_the_built_carry_holds_everything_the_device_lacks(tmp_path: Path) -> None:
    with tarfile.open(TARBALL) as tar:
        tar.extractall(tmp_path, filter="tar")
    site = tmp_path / "site"
    assert check(site) == []
    server = site / "pytriton" / "tritonserver"
    assert (server / "bin" / "tritonserver").is_file()
    assert (server / "python_backend_stubs" / "3.12" / "triton_python_backend_stub").is_file()
    assert (server / "backends" / "python" / "libtriton_python.so").is_file()
    # the server's own library and the CUDA runtime the stub links, bundled (make_carry.sh copies the
    # NEEDED closure of the binary, the backend and the stub)
    libs = {p.name.split("-")[0] for p in (site / "nvidia_pytriton.libs").iterdir()}
    assert {"libtritonserver", "libcudart"} <= libs
    assert any(p.name.startswith("numpy-1.") for p in site.glob("numpy-*.dist-info"))  # the stub's NumPy
    assert TARBALL.stat().st_size <= 55 * 2**20
