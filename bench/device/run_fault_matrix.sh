#!/usr/bin/env bash
# The fault matrix (tests/integration/test_fault_matrix.py) on the GPU KV paths: a real 1P1D unit with
# P on GPU0 and D on GPU1, tiny preset, one unit per path (proxy: with its tandem-proxy sidecar), on a
# 2-GPU machine where tandem is not installed (bench/device/device_env.sh). Writes one
# fault-matrix-<path>-gpu01.json per path, the pytest log and the servers' logs into OUT.
#
#   bench/device/run_fault_matrix.sh CARRY.tar.xz OUT [PATHS, default cuda_ipc,cuda_vmm,proxy] [VOLUME, default 10000]
set -euo pipefail
carry=${1:?carry tarball}; out=${2:?output dir}; paths=${3:-cuda_ipc,cuda_vmm,proxy}; volume=${4:-10000}
source "$(dirname "$0")/device_env.sh" "$carry" "$out"
export TANDEM_FAULT_PATHS=$paths TANDEM_FAULT_GPUS=0,1 TANDEM_FAULT_VOLUME=$volume TANDEM_FAULT_MATRIX_OUT=$out
rc=0
python3 -m pytest tests/integration/test_fault_matrix.py -p no:cacheprovider -q -s --basetemp="$out/units" \
  > "$out/pytest.log" 2>&1 || rc=$?
tail -40 "$out/pytest.log"
find "$out/units" -name '*.log' -size +0 -exec sh -c 'tail -200 "$1" > "$2/$(basename "$(dirname "$1")").log"' _ {} "$out" \;
rm -rf "$out/units"
exit $rc
