#!/usr/bin/env bash
# The FP8 and decode-kernel measurements of docs/benchmarks/README.md on one GPU, in one call: the FP8 GPU tests (and the
# bf16 kernel tests the shared code touches), the quality guard (tandem-bench-fp8, Orpheus shape, 256
# steps), the decode step bf16 against FP8 weights and FP8 weights + KV at batch 1 and 64 x 2048 for
# the Orpheus and 4B shapes (tandem-bench-decoder --forward-only --graphs), and the attention kernel
# alone with a bf16 and an E4M3 KV over tokens per split (tandem-bench-decode-attention). Stages run in
# that order while the call's budget lasts (BUDGET_S, default 540 s): a stage that would not fit is
# skipped and named, so a second call can run `STAGES=...` with the rest.
# Everything lands in OUT/fp8-run.tar.gz (logs, JSONs, PNGs) and OUT/summary.txt.
#
#   bench/device/run_fp8.sh OUT                       (all stages)
#   STAGES=decoder,attn bench/device/run_fp8.sh OUT   (some of tests,quality,decoder,attn)
set -uo pipefail
dest=${1:?output dir}  # not "out": device_env.sh sets that to its own argument
stages=${STAGES:-tests,quality,decoder,attn}
budget=${BUDGET_S:-540}
t0=$(date +%s)
work=/tmp/fp8-run && mkdir -p "$work" "$dest"
# A carried csrc/_cuda_kernels*.so (built here for sm_90 with python 3.12) is newer than the sources by
# construction; touch it so device_env.sh does not rebuild it (it rebuilds if the import fails below).
touch csrc/_cuda_kernels*.so 2> /dev/null || true
source "$(dirname "$0")/device_env.sh" - "$work" || exit 1
if ! python3 -c "import tandem.csrc._cuda_kernels as m; assert m.decode_attention_kv_fp8" 2> "$work/import.err"; then
  cat "$work/import.err"
  rm -f csrc/_cuda_kernels*.so
  python3 csrc/build_cuda.py > "$work/build_cuda.log" 2>&1 || { tail -20 "$work/build_cuda.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv > "$work/gpu.csv"
export TANDEM_BENCH_COMMIT=${TANDEM_BENCH_COMMIT:-unknown}
summary=$work/summary.txt
: > "$summary"
left() { echo $((budget - ($(date +%s) - t0))); }
# stage NAME NEEDS_S: true when STAGES names it and NEEDS_S seconds are left, else logs the skip.
stage() {
  [[ ,$stages, == *,$1,* ]] || return 1
  if [ "$(left)" -lt "$2" ]; then echo "SKIPPED $1 ($(left) s left, needs $2)" | tee -a "$summary"; return 1; fi
  echo "== $1 at $(( $(date +%s) - t0 )) s" | tee -a "$summary"
}
rc=0

if stage tests 120; then
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_fp8_kernels.py tests/unit/test_fp8.py \
    tests/unit/test_fused_decoder.py tests/unit/test_cuda_graphs.py tests/unit/test_decoder.py \
    tests/unit/test_triton_ops.py tests/unit/test_linear.py tests/unit/test_prefill_attention.py \
    "tests/unit/test_decode_attention.py::test_staged_kernel_over_a_paged_pool" \
    "tests/unit/test_decode_attention.py::test_kernel_matches_reference_at_the_serving_shape" \
    "tests/unit/test_decode_attention.py::test_kernel_ignores_slots_past_each_length" \
    > "$work/gpu-tests.log" 2>&1 || rc=$?
  grep -E "passed|failed|error" "$work/gpu-tests.log" | tail -3 | tee -a "$summary"
  grep -E "^FAILED|^ERROR" "$work/gpu-tests.log" | head -20 | tee -a "$summary"
fi

if stage quality 100; then
  timeout 200 python3 -m tandem.bench.fp8_quality --preset orpheus-3b-shape --steps 256 --out "$work" \
    --name fp8-quality-orpheus-3b-shape-h200 > "$work/quality.log" 2>&1 || rc=$?
  tail -8 "$work/quality.log" | tee -a "$summary"
fi

# decoder KIND PRESET [ENV...]: the forward-only graphed step at 1 and 64 x 2048 (kinds bf16, fp8w:
# tandem.model.dtype=fp8, fp8wkv: and tandem.kv.dtype=fp8, fp8kv: the KV alone).
decoder() {
  local kind=$1 p=$2 flags=""
  shift 2
  case $kind in
    fp8w) flags="--dtype fp8" ;;
    fp8wkv) flags="--dtype fp8 --kv-dtype fp8" ;;
    fp8kv) flags="--kv-dtype fp8" ;;
  esac
  local brk=""
  [ "$p" = orpheus-3b-shape ] && [[ $kind == bf16 || $kind == fp8wkv ]] && brk="--breakdown 64x2048"
  env "$@" timeout 150 python3 -m tandem.bench.decoder --preset "$p" --device cuda --graphs --forward-only $flags \
    $brk --batches 1,64 --context 2048 --prompts "" --steps 15 --warmup 3 --out "$work" \
    --name "step-$p-$kind" > "$work/step-$p-$kind.log" 2> "$work/step-$p-$kind.err" || rc=$?
  echo "-- $p $kind $*" >> "$summary"
  grep -E "^\|" "$work/step-$p-$kind.log" | head -6 >> "$summary"
  grep -E "forward .* ms" "$work/step-$p-$kind.err" | tee -a "$summary"
  tail -3 "$work/step-$p-$kind.err" | grep -iE "error|Traceback" >> "$summary"
}
if [[ ,$stages, == *,decoder,* ]]; then
  for p in orpheus-3b-shape qwen3-4b-shape; do
    for kind in bf16 fp8w fp8wkv; do
      stage decoder 45 && decoder "$kind" "$p"
    done
  done
fi
if stage attn 60; then  # the attention kernel alone, bf16 and E4M3 KV, over tokens per split
  for kvd in auto fp8; do
    timeout 80 python3 -m tandem.bench.decode_attention --kv-dtype $kvd --group 3 --page-sizes 16 \
      --batches 1,16,64,128 --context 2048 --chunks 0,512,1024 --ceiling --out "$work" \
      --name "attention-orpheus-$kvd" > "$work/attention-$kvd.log" 2>&1 || rc=$?
    echo "-- attention $kvd" >> "$summary"
    grep -E "^\||ceiling" "$work/attention-$kvd.log" >> "$summary"
  done
fi
echo "done at $(( $(date +%s) - t0 )) s, rc $rc" | tee -a "$summary"
cp "$summary" "$dest/summary.txt"
tar -C "$work" -czf "$dest/fp8-run.tar.gz" --exclude='*.so' .
cat "$summary"
exit $rc
