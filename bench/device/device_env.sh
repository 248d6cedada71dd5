# Sourced by the device scripts (bench/device/run_orpheus_unit.sh, run_capacity.sh, ...): make this
# checkout runnable on a GPU machine where tandem is not installed. The carry (.carry/carry.tar.xz, built
# on the CPU machine by bench/device/make_carry.sh) unpacks to /tmp/carry/site: tritonserver 2.51 and its
# python backend, and the wheels the device image lacks (tritonclient, msgspec, snac, NumPy 1.x for the
# stub, ...). A .pth in the interpreter's site-packages puts that folder and the `tandem` namespace first
# on every Python's path, the stubs' and engine workers' included: Triton's stubs ignore PYTHONPATH.
# The CUDA kernels are built into csrc/.
#
#   source bench/device/device_env.sh CARRY.tar.xz OUT      (CARRY "-": no Triton, e.g. for bench/device/run_gpu_checks.sh)
carry=${1:?carry tarball or -}; out=${2:?output dir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/carry "$out"
# Sourced again in the same machine (several scripts in one call), the carry and the kernels already
# in place are kept.
if [ "$carry" != "-" ] && [ ! -d /tmp/carry/site ]; then
  tar -C /tmp/carry -xJf "$carry"
fi
mkdir -p /tmp/pkg/tandem
for d in backend transfer csrc serving gateway cli bench wire; do ln -sfn "$PWD/$d" "/tmp/pkg/tandem/$d"; done
export PYTHONPATH=/tmp/carry/site:/tmp/pkg:$PWD
# First on the path, before site-packages: the carry's NumPy 1.x must win over the image's NumPy 2.
python3 -c 'import site; open(site.getsitepackages()[0] + "/tandem-run.pth", "w").write(
    "import sys; sys.path[:0] = [p for p in (\"/tmp/carry/site\", \"/tmp/pkg\") if p not in sys.path]\n")'
python3 -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)"
built=$(ls csrc/_cuda_kernels*.so 2>/dev/null | head -1 || true)  # none yet: ls fails, and set -e callers would exit
if [ -z "$built" ] || [ -n "$(find csrc -newer "$built" \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h' \))" ]; then
  python3 csrc/build_cuda.py > "$out/build_cuda.log" 2>&1 || { tail -20 "$out/build_cuda.log"; exit 1; }
fi
export XDG_RUNTIME_DIR=/tmp/run && mkdir -p -m 0700 "$XDG_RUNTIME_DIR"

# serve_repository REPO OUT: start tritonserver on REPO (gRPC 8001, HTTP 8000, metrics 8002; log in
# OUT/server.log), stop it when the calling script exits, and return once it is ready (or exit 1 with
# the log's tail if it dies first). Sets $server to its pid.
serve_repository() {
  python3 -m tandem.serving.launcher --model-repository "$1" --grpc-port 8001 --http-port 8000 \
    --metrics-port 8002 > "$2/server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
  for _ in $(seq 1 240); do
    if python3 -c "import urllib.request as u; u.urlopen('http://localhost:8000/v2/health/ready', timeout=2)" 2>/dev/null; then
      return 0
    fi
    kill -0 $server 2>/dev/null || { tail -40 "$2/server.log"; exit 1; }
    sleep 1
  done
}
