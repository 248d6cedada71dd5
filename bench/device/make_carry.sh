#!/usr/bin/env bash
# Build, on the CPU machine, the one tarball a lent GPU machine needs to serve and bench tandem:
# .carry/carry.tar.xz (git-ignored; at most CARRY_MAX_MIB, default 55: the device tool carries 64 MiB
# with the working tree). The device has Python 3.12, a CUDA torch, triton, pybind11 and cupy; the
# tarball holds the rest:
#   site/                     cp312 wheels installed flat (pip install --target): tritonclient[grpc] and
#                             its grpcio, protobuf, rapidjson, ml_dtypes; msgspec, tenacity, setproctitle,
#                             pysbd, tokenizers, safetensors, prometheus-client, snac + einops, soxr; NumPy
#                             1.x, which pytriton 0.7's python-backend stub needs (with NumPy 2 its BYTES
#                             tensors are garbled and it aborts)
#   site/pytriton/tritonserver, site/nvidia_pytriton.libs
#                             tritonserver 2.51, the python backend, the stub for Python 3.12, and only the
#                             bundled libraries those three load (nvidia-pytriton 0.7.0 from .venv)
# PyAV is not carried (~30 MB of FFmpeg): the `voices` model, its only user on a server, is left out of
# the bench repositories. bench/device/device_env.sh unpacks it and puts site/ first on every
# interpreter's path through a .pth (Triton's stubs ignore PYTHONPATH). Before packing, and with
# --check on an existing tarball, `python -m tandem.bench.carry` checks that every module the stubs,
# workers and benches import resolves from the carry and the device's own packages.
#
#   bench/device/make_carry.sh            # build (wheels cached in CARRY_WHEELS, default ~/.cache/tandem-carry-wheels)
#   bench/device/make_carry.sh --check    # check .carry/carry.tar.xz
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
dest=$root/.carry
tarball=$dest/carry.tar.xz
wheels=${CARRY_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem-carry-wheels}
max_mib=${CARRY_MAX_MIB:-55}
packages=(numpy==1.26.4 tritonclient==2.73.0 grpcio==1.85.4 protobuf==6.33.6 python-rapidjson==1.25
  ml-dtypes==0.5.4 packaging==26.4 urllib3==2.8.0 msgspec==0.23.0 setproctitle==1.3.8 tenacity==9.2.1
  pysbd==0.3.4 tokenizers==0.23.3 safetensors==0.8.0 prometheus-client==0.26.0 snac==1.2.1 einops==0.8.2
  soxr==1.1.0)
target=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
build=$(mktemp -d /tmp/tandem-carry.XXXX)
trap 'rm -rf "$build"' EXIT

check() {  # check SITE: every module tandem's device entries import resolves
  "$py" -m tandem.bench.carry "$1"
}

if [ "${1:-}" = --check ]; then
  [ -f "$tarball" ] || { echo "no $tarball: run bench/device/make_carry.sh first"; exit 1; }
  tar -C "$build" -xJf "$tarball"
  check "$build/site"
  exit
fi

mkdir -p "$wheels" "$dest"
"$py" -m pip download -q --no-deps "${target[@]}" -d "$wheels" "${packages[@]}"
"$py" -m pip install -q --no-deps --no-index --find-links "$wheels" "${target[@]}" --target "$build/site" \
  "${packages[@]}"
# What nothing on the device runs: tests, type stubs, byte code, console scripts, headers.
find "$build/site" -depth \( -name __pycache__ -o -name tests -o -name '*.pyi' -o -name include \) \
  -exec rm -rf {} +
rm -rf "$build/site/bin"

# tritonserver from the nvidia-pytriton wheel in .venv: the binary, the python backend, the 3.12 stub,
# and the bundled libraries they need (their NEEDED closure within nvidia_pytriton.libs).
src=$("$py" -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('pytriton').origin).parent.parent)")
server=$build/site/pytriton/tritonserver
mkdir -p "$server/python_backend_stubs" "$build/site/nvidia_pytriton.libs"
cp "$src/pytriton/__init__.py" "$build/site/pytriton/"
cp -r "$src/pytriton/tritonserver/bin" "$src/pytriton/tritonserver/backends" "$server/"
cp -r "$src/pytriton/tritonserver/python_backend_stubs/3.12" "$server/python_backend_stubs/"
libs=$src/nvidia_pytriton.libs
todo=("$server/bin/tritonserver" "$server/backends/python/libtriton_python.so"
  "$server/python_backend_stubs/3.12/triton_python_backend_stub")
while [ ${#todo[@]} -gt 0 ]; do
  file=${todo[0]}; todo=("${todo[@]:1}")
  for lib in $(readelf -d "$file" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    if [ -e "$libs/$lib" ] && [ ! -e "$build/site/nvidia_pytriton.libs/$lib" ]; then
      cp "$libs/$lib" "$build/site/nvidia_pytriton.libs/"
      todo+=("$libs/$lib")
    fi
  done
done

check "$build/site"
tar -C "$build" -cf - site | xz -T2 -6 > "$tarball.tmp"
mv "$tarball.tmp" "$tarball"
size=$(stat -c %s "$tarball")
echo "wrote $tarball: $((size / 1048576)) MiB ($(du -sm "$build/site" | cut -f1) MiB unpacked)"
if [ "$size" -gt $((max_mib * 1048576)) ]; then
  echo "the carry is over $max_mib MiB: the device tool carries 64 MiB with the working tree"
  exit 1
fi
