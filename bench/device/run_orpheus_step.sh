#!/usr/bin/env bash
# D's step on one GPU, piece by piece, before the served unit (bench/device/run_orpheus_unit.sh) measures
# it whole: the GPU tests of the paths these figures rest on (legal-id sampling, CUDA graphs, the
# running batch, paged decode attention, CSM's frame step, the unit's MPS daemon), then
#   sampler      the output head + sampler per stream over the whole vocabulary against the Orpheus
#                slot's 4,097 legal ids (tandem.bench.sampler: b per stream against the head's roofline)
#   decode loop  D's loop at 1-256 streams x 1,024 tokens of context, grammar on and off, with the
#                start-up calibration's step model a + b x batch + c x tokens beside the timed steps
#   prefill      P's forward for 16-128-row prompts (an Orpheus prompt is 30-120 rows), its kernel
#                breakdown, and the first call at 8 new lengths (what a cold length costs)
# each stage under its own time limit so one that hangs leaves the others their figures. One device
# call (carry: [".carry"], <= 10 minutes); OUT gets every log, JSON and PNG, and summary.txt.
#
#   bash bench/device/run_orpheus_step.sh .carry/carry.tar.xz OUT
#   STEP_STAGES=sampler,loop bash bench/device/run_orpheus_step.sh ...   (any of tests,sampler,loop,prefill)
set -uo pipefail
carry=${1:?carry tarball}; out=${2:?output dir}
stages=${STEP_STAGES:-tests,sampler,loop,prefill}
source "$(dirname "$0")/device_env.sh" "$carry" "$out" > "$out/env.log" 2>&1 || { cat "$out/env.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$out/gpu.csv" || true
summary=$out/summary.txt; : > "$summary"
rc=0
stage() {  # stage NAME SECONDS CMD...: run CMD under a limit, log to OUT/NAME.log, its tail to the summary
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || { local r=$?; rc=$r; echo "$name: exit $r" >> "$summary"; }
  { echo "== $name"; tail -25 "$out/$name.log"; } >> "$summary"
}
if [[ ,$stages, == *,tests,* ]]; then
  stage gpu-tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_legal_sampling_gpu.py \
    tests/unit/test_cuda_graphs.py tests/unit/test_batch.py tests/unit/test_decode_attention.py \
    tests/unit/test_csm_gpu.py tests/process/test_mps_daemon.py
fi
if [[ ,$stages, == *,sampler,* ]]; then
  stage sampler 90 python3 -m tandem.bench.sampler --preset orpheus-3b-shape --device cuda --out "$out"
fi
if [[ ,$stages, == *,loop,* ]]; then
  for g in orpheus off; do
    stage "decode-loop-$g" 110 python3 -m tandem.bench.decode_loop --preset orpheus-3b-shape --device cuda \
      --grammar $g --batches 1,16,64,128,256 --context 1024 --host-ms 0 --modes pipelined --probes 0 \
      --calibrate --out "$out" --name "decode-loop-orpheus-$g"
  done
fi
if [[ ,$stages, == *,prefill,* ]]; then
  stage prefill 90 python3 -m tandem.bench.decoder --preset orpheus-3b-shape --device cuda \
    --prompts 16,32,64,128 --batches 1 --context 1024 --prefill-breakdown 32,128 --distinct-lengths 8 \
    --out "$out" --name prefill-short
fi
cat "$summary"
exit $rc
