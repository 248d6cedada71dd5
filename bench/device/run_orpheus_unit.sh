#!/usr/bin/env bash
# Orpheus served end to end on one GPU: an Orpheus-3B-shape random-weight LM (preset orpheus-3b-shape:
# Llama-3.2-3B, llama3 RoPE scaling, 156,940 ids; `--family orpheus`, so P samples under Orpheus'
# audio-token grammar and hands it to D, as a real Orpheus stream is) with the real-config SNAC 24 kHz
# (random weights, decoder noise on as shipped) behind the vocoder, P, D and the vocoder all on GPU 0
# (cuda_ipc), served by `tandem-unit --mps on` (serving/mps.py: one CUDA MPS daemon of the unit's, so
# the three processes' contexts do not time-slice the GPU) and driven by tandem-bench over the levels
# (TTFA p50/p95, per-stream tok/s against the 164 tok/s floor = Orpheus' 82.03 tok/s real time over
# RTF 0.5, responses without audio before the first that sounds); then the codec alone at scale.
# Not a PD capacity figure: P's prefills, D's steps and SNAC share one device.
#
# One device call of <= 9 minutes with the server's start: the bench stops at ORPHEUS_BUDGET_S
# (default 450 s from the script's start; the levels done so far are kept), the codec runs only if
# 60 s are left. OUT gets at most 5 files: summary.txt (the table, C=1's waterfall, D's step model a,
# b, c as D logged it, MPS' server list), bench.json, bench.png, metrics.txt and run.tar.gz (every log,
# the trace, the codec's JSONs).
#
#   bash bench/device/run_orpheus_unit.sh .carry/carry.tar.xz OUT   # the GPU machine (carry: bench/device/make_carry.sh)
#   PATH=$PWD/.venv/bin:$PATH bench/device/run_orpheus_unit.sh cpu OUT   # CPU dry run of the same steps:
#                                                 # a small Orpheus-layout LM, short streams, few levels
# Environment: ORPHEUS_LEVELS (default 1,16,64,128,192,256,400), ORPHEUS_ROUNDS (requests per level =
# rounds x C, default 1), ORPHEUS_WARMUP (default 8), ORPHEUS_RTF (the bench's floor: real time over it,
# default 0.5; 1.0 judges at real time), ORPHEUS_MPS (off, auto, on; default on), ORPHEUS_D_POOL (D's
# pool as a share of the GPU's memory, default 0.45; max_batch 0 then follows it up to 512),
# ORPHEUS_SET (space-separated MODEL:KEY=VALUE settings, as CAPACITY_SET). FP8:
#   ORPHEUS_SET="prefill:tandem.model.dtype=fp8 decode:tandem.model.dtype=fp8" bash bench/device/run_orpheus_unit.sh ...
set -euo pipefail
carry=${1:?carry tarball, or cpu}; dest=${2:?output dir}; shift 2  # not "out": device_env.sh sets that
t0=$(date +%s)
budget=${ORPHEUS_BUDGET_S:-450}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest"
work=$(mktemp -d /tmp/orpheus-unit.XXXX)
res=$work/res && mkdir -p "$res"
left() { echo $((budget - ($(date +%s) - t0))); }

# pack: OUT gets the summary, the bench's JSON and plot, the metrics, and one tarball of the rest.
pack() {
  for f in bench/bench.json bench/bench.png metrics.txt summary.txt; do
    [ -e "$res/$f" ] && cp "$res/$f" "$dest/"
  done
  tar -C "$res" -czf "$dest/run.tar.gz" --exclude=bench.png .
}
unit=""
trap '[ -n "$unit" ] && { kill -TERM $unit 2>/dev/null; wait $unit 2>/dev/null; }; pack; rm -rf "$work"' EXIT

if [ "$carry" = cpu ]; then
  base=${TANDEM_PORT_BASE:-18500}; grpc=$((base + 1)); http=$base; metrics=$((base + 2))
  export XDG_RUNTIME_DIR=$work/run && mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
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
  levels=${ORPHEUS_LEVELS:-1,2}; mps=${ORPHEUS_MPS:-auto}
  trace_args="n=16, prompt_rows=(20, 40), text_rows=(4, 10), output_rows=(21, 35), voices=4"
  bench_args=(--rounds "${ORPHEUS_ROUNDS:-1}"); codec_args=(--device cpu --streams 1,2 --reps 1 --warmup 0)
  codec_s=600  # SNAC on a 2-core CPU is slower than real time
else
  source "$here/device_env.sh" "$carry" "$res" > /dev/null
  grpc=8001; http=8000; metrics=8002
  python3 -c "import snac, einops, tritonclient.grpc, msgspec" || { echo "the carry lacks a module: rebuild it"; exit 1; }
  source_args=(--preset orpheus-3b-shape --family orpheus --dtype bfloat16)
  place_args=(--prefill-gpus 0 --decode-gpus 0 --vocoder-gpus 0 --pool-pages 12288 --max-batch 0 --path cuda_ipc
    --set "decode:tandem.pool.memory_fraction=${ORPHEUS_D_POOL:-0.45}"
    --set "decode:tandem.transfer.deadline_s=10" --set "decode:tandem.batch.max_queue=1024"
    --set "decode:tandem.batch.graph_warmup_context=1024")
  levels=${ORPHEUS_LEVELS:-1,16,64,128,192,256,400}; mps=${ORPHEUS_MPS:-on}
  # text 20-400 characters (~5-100 rows), output up to 1,200 tokens
  trace_args="n=1024, prompt_rows=(30, 120), text_rows=(5, 100), output_rows=(300, 1200), voices=8"
  bench_args=(--rounds "${ORPHEUS_ROUNDS:-1}" --warmup "${ORPHEUS_WARMUP:-8}" --ramp-s 2)
  codec_args=(--device cuda --streams 1,16,64,128,256); codec_s=60
  nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > "$res/gpu.csv" || true
fi

python3 -m tandem.bench.codec --write-random "$work/snac" --noise > "$res/snac.log"
python3 -m tandem.cli.make_repository --out "$work/repo" "${source_args[@]}" --codec "$work/snac" \
  "${place_args[@]}" $(for kv in ${ORPHEUS_SET:-}; do printf -- '--set %s ' "$kv"; done) > "$res/repo.log"
cat "$res/repo.log"
# tts_mono needs a GPU of its own; voices (reference registration) needs PyAV, which the carry leaves out
rm -rf "$work/repo/tts_mono" "$work/repo/voices"
python3 -c "from pathlib import Path; from tandem.bench.trace import generate, save; \
save(Path('$res/trace.jsonl'), generate($trace_args))"

python3 -m tandem.serving.supervisor --mps "$mps" -- --model-repository "$work/repo" --grpc-port $grpc \
  --http-port $http --metrics-port $metrics > "$res/unit.log" 2>&1 &
unit=$!
for _ in $(seq 1 300); do
  python3 -c "import urllib.request as u; u.urlopen('http://localhost:$http/v2/health/ready', timeout=2)" \
    2>/dev/null && break
  kill -0 $unit 2>/dev/null || { tail -40 "$res/unit.log"; exit 1; }
  sleep 1
done
summary=$res/summary.txt
{
  echo "ready at $(( $(date +%s) - t0 )) s; levels $levels; mps $mps"
  grep -E "MPS|seeded|captured [0-9]+ decode graphs|decode: transfer path" "$res/unit.log" | cut -c1-300 || true
} | tee "$summary"
pipes=$(sed -n 's/.*control daemon with pipes in \(\S*\).*/\1/p' "$res/unit.log" | tail -1)

rc=0
timeout $(( $(left) > 30 ? $(left) : 30 )) python3 -m tandem.bench.capacity --url localhost:$grpc \
  --metrics-url http://localhost:$metrics/metrics --models tts --levels "$levels" --trace "$res/trace.jsonl" \
  --rtf "${ORPHEUS_RTF:-0.5}" "${bench_args[@]}" --out "$res/bench" "$@" > "$res/bench.log" 2>&1 || rc=$?
[ $rc = 124 ] && echo "the bench stopped at the budget ($budget s): the levels done are in bench.json" | tee -a "$summary"
if [ -n "$pipes" ]; then  # the MPS server and its clients (the engines), read while they run
  echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=$pipes nvidia-cuda-mps-control > "$res/mps.txt" 2>&1 || true
  echo "MPS servers: $(tr '\n' ' ' < "$res/mps.txt")" >> "$summary"
fi
python3 -c "import urllib.request as u; print(u.urlopen('http://localhost:$metrics/metrics').read().decode())" \
  | grep '^tandem_' > "$res/metrics.txt" || true
{
  # each level's row once (printed as the level ends, again in the final table), then the capacity
  grep -E "^\|" "$res/bench.log" | awk '!seen[$0]++' || true
  grep -E "^tts: (capacity|with TTFA)" "$res/bench.log" || tail -20 "$res/bench.log"
  grep -E "C=1 waterfall" "$res/bench.log" || true
  echo "D's step model (a fixed, b per stream, c per token), as D logged it when its rate floor held:"
  grep -oE "rate floor holds admission at [0-9]+ streams.*" "$res/unit.log" | tail -5 || echo "  (never held)"
} | tee -a "$summary"

if [ "$(left)" -ge 60 ]; then
  # The served SNAC (noise on, as shipped) at scale; then streamed-vs-offline SNR with noise off.
  timeout $codec_s python3 -m tandem.bench.codec --snac "$work/snac" "${codec_args[@]}" --snr-frames 0 --out "$res/codec" \
    > "$res/codec.log" 2>&1 || rc=$?
  tail -10 "$res/codec.log" | tee -a "$summary"
  timeout $codec_s python3 -m tandem.bench.codec --random "${codec_args[@]}" --streams 1 --snr-frames 12 --out "$res/codec-snr" \
    > "$res/codec-snr.log" 2>&1 || rc=$?
  tail -4 "$res/codec-snr.log" | tee -a "$summary"
else
  echo "codec bench skipped: $(left) s left of $budget" | tee -a "$summary"
fi
echo "unit log tracebacks: $(grep -c Traceback "$res/unit.log" || true); done at $(( $(date +%s) - t0 )) s, rc $rc" \
  | tee -a "$summary"
exit $rc
