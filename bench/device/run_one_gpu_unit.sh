#!/usr/bin/env bash
# A 1P1D unit squeezed onto one GPU (P and D both on GPU 0, cuda_ipc, 4B-shape decoder), served by the
# real tritonserver and driven by tandem-bench over gRPC: the whole GPU serving path (graph warm-up,
# D's start-up calibration, direct writes, the pipelined decode loop, metrics) where only one GPU is
# lent. Not a capacity figure: P's prefills and D's steps share one device, so D's step times (and its
# busy fraction, which counts the device time of P's kernels between D's events) are P's too.
#
#   bench/device/run_one_gpu_unit.sh CARRY.tar.xz OUT [tandem-bench args...]
# CAPACITY_SET (optional, space-separated MODEL:KEY=VALUE) adds settings, as for bench/device/run_capacity.sh.
set -euo pipefail
carry=${1:?carry tarball}; out=${2:?output dir}; shift 2
source "$(dirname "$0")/device_env.sh" "$carry" "$out" > /dev/null
rm -rf /tmp/repo
python3 -m tandem.cli.make_repository --out /tmp/repo --preset qwen3-4b-shape --dtype bfloat16 \
  --prefill-gpus 0 --decode-gpus 0 --mono-gpus 0 --pool-pages 12288 --max-batch 64 --path cuda_ipc \
  --set "decode:tandem.transfer.deadline_s=10" --set "decode:tandem.batch.max_queue=1024" \
  --set "decode:tandem.batch.graph_warmup_context=2560" \
  $(for kv in ${CAPACITY_SET:-}; do printf -- '--set %s ' "$kv"; done) > "$out/repo.log"
rm -rf /tmp/repo/tts_mono  # the monolithic baseline needs its own GPUs: not here
rm -rf /tmp/repo/voices  # reference registration needs PyAV, which the carry leaves out
serve_repository /tmp/repo "$out"
grep -E "seeded|captured [0-9]+ decode graphs|decode: transfer path" "$out/server.log" | cut -c1-300 || true
python3 -m tandem.bench.capacity --url localhost:8001 --models tts --out "$out" "$@" > "$out/bench.log" 2>&1
tail -8 "$out/bench.log"
echo "server log tracebacks: $(grep -c Traceback "$out/server.log" || true)"
