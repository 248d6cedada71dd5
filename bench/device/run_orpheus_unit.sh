#!/usr/bin/env bash
# Orpheus served end to end on one GPU: an Orpheus-3B-shape random-weight LM (preset orpheus-3b-shape:
# Llama-3.2-3B, llama3 RoPE scaling, 156,940 ids) with the real-config SNAC 24 kHz (random weights,
# decoder noise on as shipped) behind the vocoder, P, D and the vocoder all on GPU 0 (cuda_ipc), served
# by the real tritonserver and driven by tandem-bench at 1, 16 and 64 streams (TTFA p50/p95, per-stream
# tok/s against the 164 tok/s floor = Orpheus' 82.03 tok/s real time over RTF 0.5); then the codec
# alone at scale (tandem-bench-codec: audio seconds per wall second, the codec's share of a chunk).
# Not a PD capacity figure: P's prefills, D's steps and SNAC share one device.
#
#   bench/device/run_orpheus_unit.sh CARRY.tar.xz OUT      # the GPU machine (bench/device/device_env.sh); the snac and
#                                                 # einops wheels lie beside the carry tarball
#   PATH=$PWD/.venv/bin:$PATH bench/device/run_orpheus_unit.sh cpu OUT   # CPU dry run of the same steps:
#                                                 # a small Orpheus-layout LM, short streams, few levels
# ORPHEUS_SET (optional, space-separated MODEL:KEY=VALUE) adds settings, as CAPACITY_SET does; on the GPU,
# ORPHEUS_LEVELS (default 1,16,64,128,256,400: issue 26's levels) and ORPHEUS_D_POOL (D's pool as a share
# of the GPU's memory, default 0.45; max_batch 0 then follows it up to 512) size the run. FP8:
#   ORPHEUS_SET="prefill:tandem.model.dtype=fp8 decode:tandem.model.dtype=fp8" bench/device/run_orpheus_unit.sh ...
set -euo pipefail
carry=${1:?carry tarball, or cpu}; out=${2:?output dir}; shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
work=$(mktemp -d /tmp/orpheus-unit.XXXX)

if [ "$carry" = cpu ]; then
  base=${TANDEM_PORT_BASE:-18500}; grpc=$((base + 1)); http=$base; metrics=$((base + 2))
  # A small LM with Orpheus' layout (W=1, 156,940 ids, Llama): tandem-repo detects the family from it.
  python3 - "$work/ckpt" <<'EOF'
import sys
import torch
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
cfg = ModelConfig(name="orpheus-layout-tiny", vocab_size=156940, row_width=1, hidden_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, eos_token_id=128258)
save_checkpoint(Decoder.random(cfg, seed=0), sys.argv[1])
EOF
  source_args=(--checkpoint "$work/ckpt")
  place_args=(--pool-pages 1024 --max-batch 8)
  levels=1,2; trace_args="n=16, prompt_rows=(20, 40), text_rows=(4, 10), output_rows=(21, 35), voices=4"
  bench_args=(--rounds 1); codec_args=(--device cpu --streams 1,2 --reps 1 --warmup 0)
else
  source "$here/device_env.sh" "$carry" "$out" > /dev/null
  grpc=8001; http=8000; metrics=8002
  # snac (and einops, which it imports) are not in the device image: wheels carried beside the tarball.
  for whl in "$(dirname "$carry")"/snac-1.2.1-*.whl "$(dirname "$carry")"/einops-*.whl; do
    [ -e "$whl" ] && python3 -m pip install -q --no-index --no-deps "$whl"
  done
  python3 -c "import snac, einops" || { echo "snac/einops missing: carry their wheels"; exit 1; }
  source_args=(--preset orpheus-3b-shape --family orpheus --dtype bfloat16)
  place_args=(--prefill-gpus 0 --decode-gpus 0 --vocoder-gpus 0 --pool-pages 12288 --max-batch 0 --path cuda_ipc
    --set "decode:tandem.pool.memory_fraction=${ORPHEUS_D_POOL:-0.45}"
    --set "decode:tandem.transfer.deadline_s=10" --set "decode:tandem.batch.max_queue=1024"
    --set "decode:tandem.batch.graph_warmup_context=1024")
  levels=${ORPHEUS_LEVELS:-1,16,64,128,256,400}
  # issue 26's trace: text 20-400 characters (~5-100 rows), output up to 1,200 tokens
  trace_args="n=1024, prompt_rows=(30, 120), text_rows=(5, 100), output_rows=(300, 1200), voices=8"
  bench_args=(--rounds 2 --warmup 8 --ramp-s 2); codec_args=(--device cuda --streams 1,16,64,128,256)
fi

python3 -m tandem.bench.codec --write-random "$work/snac" --noise > "$out/snac.log"
python3 -m tandem.cli.make_repository --out "$work/repo" "${source_args[@]}" --codec "$work/snac" \
  "${place_args[@]}" $(for kv in ${ORPHEUS_SET:-}; do printf -- '--set %s ' "$kv"; done) > "$out/repo.log"
cat "$out/repo.log"
rm -rf "$work/repo/tts_mono"  # the monolithic baseline needs its own GPU: not here
python3 -c "from pathlib import Path; from tandem.bench.trace import generate, save; \
save(Path('$out/trace.jsonl'), generate($trace_args))"

python3 -m tandem.serving.launcher --model-repository "$work/repo" --grpc-port $grpc --http-port $http \
  --metrics-port $metrics > "$out/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 1 300); do
  python3 -c "import urllib.request as u; u.urlopen('http://localhost:$http/v2/health/ready', timeout=2)" \
    2>/dev/null && break
  kill -0 $server 2>/dev/null || { tail -40 "$out/server.log"; exit 1; }
  sleep 1
done
grep -E "seeded|captured [0-9]+ decode graphs|decode: transfer path" "$out/server.log" | cut -c1-300 || true

python3 -m tandem.bench.capacity --url localhost:$grpc --metrics-url http://localhost:$metrics/metrics --models tts \
  --levels $levels --trace "$out/trace.jsonl" "${bench_args[@]}" --out "$out/bench" "$@" > "$out/bench.log" 2>&1
tail -8 "$out/bench.log"
# The served SNAC (noise on, as shipped) at scale; then streamed-vs-offline SNR with noise off.
python3 -m tandem.bench.codec --snac "$work/snac" "${codec_args[@]}" --snr-frames 0 --out "$out/codec" \
  > "$out/codec.log" 2>&1
tail -10 "$out/codec.log"
python3 -m tandem.bench.codec --random "${codec_args[@]}" --streams 1 --snr-frames 12 --out "$out/codec-snr" \
  > "$out/codec-snr.log" 2>&1
tail -9 "$out/codec-snr.log"
echo "server log tracebacks: $(grep -c Traceback "$out/server.log" || true)"
