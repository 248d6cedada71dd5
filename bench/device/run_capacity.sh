#!/usr/bin/env bash
# PD (1P1D: P on GPU0, D on GPU1) against monolithic (one tts_mono instance per GPU) on one trace,
# on a 2-GPU machine where tandem is not installed (bench/device/device_env.sh: carried Triton, repo on
# PYTHONPATH, CUDA kernels built). Writes server logs and bench results into OUT.
#
#   bench/device/run_capacity.sh CARRY.tar.xz OUT PATH [tandem-bench args...]
#
# CAPACITY_SET (optional, space-separated MODEL:KEY=VALUE) adds settings to the rendered repository,
# e.g. CAPACITY_SET="decode:tandem.batch.paged_attention=false tts_mono:tandem.batch.paged_attention=false".
set -euo pipefail
carry=${1:?carry tarball}; out=${2:?output dir}; path=${3:?transfer path}; shift 3
source "$(dirname "$0")/device_env.sh" "$carry" "$out"
rm -rf /tmp/repo
python3 -m tandem.cli.make_repository --out /tmp/repo --preset qwen3-4b-shape --dtype bfloat16 \
  --prefill-gpus 0 --decode-gpus 1 --mono-gpus 0,1 --pool-pages 12288 --max-batch 64 \
  --path "$path" \
  --set "decode:tandem.transfer.arena_mb=8192" --set "decode:tandem.transfer.deadline_s=10" \
  --set "tts_mono:tandem.batch.max_queue=1024" --set "decode:tandem.batch.max_queue=1024" \
  --set "tts_mono:tandem.batch.graph_warmup_context=2560" --set "decode:tandem.batch.graph_warmup_context=2560" \
  $(for kv in ${CAPACITY_SET:-}; do printf -- '--set %s ' "$kv"; done)
rm -rf /tmp/repo/voices  # reference registration needs PyAV, which the carry leaves out
serve_repository /tmp/repo "$out"
nvidia-smi --query-gpu=index,name,memory.used --format=csv > "$out/gpus.csv"
python3 -m tandem.bench.capacity --url localhost:8001 --models tts,tts_mono --gpus tts=2,tts_mono=2 --out "$out" "$@"
python3 -c "import urllib.request as u; print(u.urlopen('http://localhost:8002/metrics').read().decode())" \
  | grep '^tandem_' > "$out/metrics.txt" || true
