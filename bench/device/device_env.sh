# Sourced by the device scripts (bench/device/run_capacity.sh, bench/device/run_fault_matrix.sh): make this checkout
# runnable on a GPU machine where tandem is not installed. Triton comes from a carried tarball of the
# nvidia-pytriton wheel's server, binary and libraries (plus tritonclient's gRPC client); the repo goes
# on PYTHONPATH as the `tandem` namespace; the CUDA kernels are built into csrc/.
#
#   source bench/device/device_env.sh CARRY.tar.xz OUT      (CARRY "-": no Triton, e.g. for bench/device/run_gpu_checks.sh)
carry=${1:?carry tarball or -}; out=${2:?output dir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/carry "$out"
# Sourced again in the same machine (several scripts in one call), the carry, NumPy and the kernels
# already in place are kept.
if [ "$carry" != "-" ] && [ ! -d /tmp/carry/pytriton ]; then
  tar -C /tmp/carry -xJf "$carry"
  # pytriton 0.7's python-backend stub is built against NumPy 1.x: with NumPy 2 its BYTES tensors are
  # garbled and the stub aborts. Install a NumPy 1.x wheel carried beside the tarball, if there is one.
  # tritonclient's grpc module imports rapidjson, which the device image lacks: carry its wheel too.
  for whl in "$(dirname "$carry")"/numpy-1.*.whl "$(dirname "$carry")"/python_rapidjson-*.whl; do
    [ -e "$whl" ] && python3 -m pip install -q --no-index --no-deps --force-reinstall "$whl"
  done
fi
python3 -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)"
mkdir -p /tmp/pkg/tandem
for d in backend transfer csrc serving gateway cli bench; do ln -sfn "$PWD/$d" "/tmp/pkg/tandem/$d"; done
export PYTHONPATH=/tmp/pkg:/tmp/carry:$PWD
# Triton's python stubs ignore PYTHONPATH but read the interpreter's site-packages: a .pth puts tandem there.
python3 -c 'import site; open(site.getsitepackages()[0] + "/tandem-run.pth", "w").write("/tmp/pkg\n")'
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
