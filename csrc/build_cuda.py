"""Builds `tandem.csrc._cuda_kernels` (KV row kernels and checksum, paged decode attention, small-batch
linear, CUDA IPC/VMM).

    python csrc/build_cuda.py [--arch 90] [--nvcc PATH]

Writes `csrc/_cuda_kernels<EXT_SUFFIX>` next to this file: sm_<arch> machine code plus compute_<arch>
PTX (so a newer GPU can JIT it). Needs nvcc and pybind11's headers, not libtorch: the module links only
the static CUDA runtime and resolves driver calls at run time, so it imports on machines without a
driver (its calls raise there) and `tandem.csrc.kv_cuda` falls back to torch when it is absent.
Exits non-zero with the compiler's output on any failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


def nvcc_path(explicit: str | None) -> str:
    candidates = [
        explicit,
        shutil.which("nvcc"),
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
    ]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    raise SystemExit("build_cuda: nvcc not found (set CUDA_HOME or pass --nvcc)")


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"build_cuda: command failed with exit code {proc.returncode}")


def build(arch: str, nvcc: str) -> Path:
    import pybind11

    includes = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{HERE}"]
    gencode = [
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        f"-gencode=arch=compute_{arch},code=compute_{arch}",
    ]
    common = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", *includes]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    out = HERE / f"_cuda_kernels{suffix}"
    with tempfile.TemporaryDirectory() as tmp:
        sources = (
            "kv_kernels.cu",
            "kv_checksum.cu",
            "decode_attention.cu",
            "decode_attention_staged.cu",
            "decode_attention_mma.cu",
            "gemv.cu",
        )
        objs = [os.path.join(tmp, name.replace(".cu", ".o")) for name in sources]
        mod = os.path.join(tmp, "cuda_module.o")
        pairs = zip(sources, objs, strict=True)
        cmds = [[nvcc, *common, *gencode, "-c", str(HERE / n), "-o", o] for n, o in pairs]
        cmds.append([nvcc, *common, "-c", str(HERE / "cuda_module.cpp"), "-o", mod])
        # One process per file, in parallel: the decode-attention templates take most of the build.
        with ThreadPoolExecutor(max_workers=len(cmds)) as pool:
            list(pool.map(run, cmds))
        tmp_out = os.path.join(tmp, out.name)
        run([nvcc, "-shared", *gencode, "-cudart=static", *objs, mod, "-o", tmp_out])
        shutil.move(tmp_out, out)
    print(f"build_cuda: wrote {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90", help="compute capability without the dot (default 90: Hopper)")
    ap.add_argument("--nvcc", default=None)
    args = ap.parse_args(argv)
    build(args.arch, nvcc_path(args.nvcc))


if __name__ == "__main__":
    main()
