#!/usr/bin/env bash
# What one GPU can check, on a GPU machine where tandem is not installed (bench/device/device_env.sh): the GPU
# unit tests, P's direct-mode write with its hash before or inside it (tandem-bench-checksum), and D's
# decode loop serial against pipelined, with joining streams timed and the start-up calibration
# (tandem-bench-decode-loop; batches up to 88 + 8 joiners: D's 96-row graph). Writes logs and result
# JSON/PNG into OUT; the last lines printed are the tables. The carry is needed for tritonclient,
# which some unit test modules import.
#
#   bench/device/run_gpu_checks.sh CARRY.tar.xz OUT [pytest -k expression]
#   GPU_CHECKS=loop bench/device/run_gpu_checks.sh ...      (any of tests,checksum,loop; default all three)
set -uo pipefail
carry=${1:?carry tarball}; out=${2:?output dir}; select=${3:-}
checks=${GPU_CHECKS:-tests,checksum,loop}
source "$(dirname "$0")/device_env.sh" "$carry" "$out" || exit 1
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv > "$out/gpus.csv"
rc=0
if [[ ,$checks, == *,tests,* ]]; then
  timeout 300 python3 -m pytest tests/unit tests/process -m gpu -q -p no:cacheprovider ${select:+-k "$select"} \
    > "$out/gpu-tests.log" 2>&1 || rc=$?
  tail -15 "$out/gpu-tests.log"
fi
if [[ ,$checks, == *,checksum,* ]]; then
  python3 -m tandem.bench.checksum --device cuda:0 --paths rows,write --reps 30 --out "$out" \
    --name checksum-write-h200 > "$out/checksum-write.log" 2>&1 || rc=$?
  cat "$out/checksum-write.log"
fi
if [[ ,$checks, == *,loop,* ]]; then
  python3 -m tandem.bench.decode_loop --preset qwen3-4b-shape --device cuda --dtype bfloat16 \
    --batches 8,32,64,88 --context 1024,2048 --host-ms 0,3 --probes 8 --calibrate \
    --steps 30 --out "$out" --name decode-loop-qwen3-4b-shape-h200 2> "$out/decode-loop.log" || rc=$?
  tail -5 "$out/decode-loop.log"
fi
exit $rc
