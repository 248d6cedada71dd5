#!/usr/bin/env bash
# The decoder's kernels on one GPU: their GPU tests, the paged-attention kernel against HBM
# (tandem-bench-decode-attention), ncu on it at 64 x 2048, and the forward-only decode step against its
# roofline for each preset, fused (this tree's step) and with the reference kernels (the torch modules
# one by one), with a kernel-family breakdown. Writes logs and JSON/PNG into OUT; prints the tables.
#
# Other steps: prefill (prefill with flash and with cuDNN padded to buckets, TANDEM_PREFILL_ATTENTION),
# linear (tandem-bench-linear per preset: cuBLAS, cuBLASLt and the GEMV), split (the attention over
# tokens-per-split, against a copy/sum of the same bytes), and decoder kind cublas (the step with the
# GEMV off, TANDEM_GEMV_ROWS=0) beside decoder. The fused split-K merge and TANDEM_BLAS were measured
# and deleted (docs/benchmarks/README.md).
#
#   bench/device/run_decoder_roofline.sh OUT [PRESETS] [STEPS: tests,attention,ncu,decoder,reference]
#   e.g. bench/device/run_decoder_roofline.sh OUT qwen3-4b-shape,orpheus-3b-shape tests,split,linear,prefill,ncu,decoder,cublas
set -uo pipefail
out=${1:?output dir}; presets=${2:-qwen3-4b-shape}; steps=${3:-tests,attention,ncu,decoder,reference}
source "$(dirname "$0")/device_env.sh" - "$out" || exit 1
export TANDEM_BENCH_COMMIT=${TANDEM_BENCH_COMMIT:-unknown}
rc=0
if [[ ,$steps, == *,tests,* ]]; then
  timeout 400 python3 -m pytest -m gpu -q -p no:cacheprovider -x tests/unit/test_triton_ops.py \
    tests/unit/test_fused_decoder.py tests/unit/test_decode_attention.py tests/unit/test_cuda_graphs.py \
    tests/unit/test_decoder.py tests/unit/test_gpu_kernels.py tests/unit/test_linear.py tests/unit/test_prefill_attention.py \
    > "$out/gpu-tests.log" 2>&1 || rc=$?
  tail -15 "$out/gpu-tests.log"
fi
if [[ ,$steps, == *,attention,* ]]; then
  python3 -m tandem.bench.decode_attention --out "$out" > "$out/attention.log" 2>&1 || rc=$?
  tail -90 "$out/attention.log"
fi
if [[ ,$steps, == *,ncu,* ]] && command -v ncu > /dev/null; then
  cat > /tmp/ncu_attn.py <<'PY'
import torch
from tandem.csrc import kv_cuda
b, s, kvh, g, hd = 64, 2048, 8, 4, 128
kv = torch.randn(2, b * s, kvh, hd, device="cuda").bfloat16()
slots = torch.randperm(b * s, device="cuda").view(b, s).contiguous()
lengths = torch.full((b,), s, dtype=torch.long, device="cuda")
q = torch.randn(b, kvh * g, hd, device="cuda").bfloat16()
kv_cuda.decode_attention(q, kv, slots, lengths, hd**-0.5)
if hasattr(kv_cuda.module(), "gemv"):  # the GEMV (opt-in) at batch 1: gate-up and down of the 4B shape
    from tandem.csrc import linear
    for n, k in ((19456, 2560), (2560, 9728)):
        w = torch.randn(n, k, device="cuda").bfloat16()
        linear.linear(torch.randn(1, k, device="cuda").bfloat16(), w, max_rows=8)
torch.cuda.synchronize()
PY
  timeout 240 ncu --clock-control none -k regex:"decode_partial|gemv" -c 3 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 /tmp/ncu_attn.py > "$out/ncu-attention.txt" 2>&1 || rc=$?
  grep -E "decode_partial|gemv_kernel|Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers|Stall|L1/TEX Hit|Theoretical Occ" "$out/ncu-attention.txt" | head -70
fi
if [[ ,$steps, == *,split,* ]]; then
  python3 -m tandem.bench.decode_attention --chunks 0,128,256,512,1024 \
    --page-sizes 16 --batches 1,4,16,64,128 --context 1024,2048 --ceiling --out "$out" \
    --name decode-attention-split > "$out/attention-split.log" 2>&1 || rc=$?
  tail -90 "$out/attention-split.log"
fi
for p in ${presets//,/ }; do
  if [[ ,$steps, == *,linear,* ]]; then
    python3 -m tandem.bench.linear --preset "$p" --out "$out" --name "linear-$p" > "$out/linear-$p.log" 2>&1 || rc=$?
    tail -95 "$out/linear-$p.log"
  fi
done
if [[ ,$steps, == *,prefill,* ]]; then  # prefill attention: flash (default) against cuDNN padded to buckets
  for p in ${presets//,/ }; do
    for mode in flash cudnn; do
      TANDEM_PREFILL_ATTENTION=$mode python3 -m tandem.bench.decoder --preset "$p" --device cuda \
        --forward-only --batches 1 --context 2048 --steps 10 --warmup 2 --prefill-reps 7 \
        --prompts 128,1024,1100,1500,2048,4096 --prefill-breakdown 2048 --out "$out" \
        --name "prefill-$p-$mode" > "$out/prefill-$p-$mode.log" 2>&1 || rc=$?
      grep -A9 "^prefill" "$out/prefill-$p-$mode.log" | head -12
    done
  done
fi
# kinds: decoder (this tree's step), reference (the torch modules one by one), cublas
# (the GEMV off).
for p in ${presets//,/ }; do
  for kind in decoder reference cublas; do
    [[ ,$steps, == *,$kind,* ]] || continue
    flag=""; [ "$kind" = reference ] && flag="--reference-kernels"
    gemv=8; [ "$kind" = cublas ] && gemv=0
    TANDEM_GEMV_ROWS=$gemv python3 -m tandem.bench.decoder --preset "$p" --device cuda --graphs \
      --forward-only $flag --breakdown 1x2048,64x2048 --batches 1,8,32,64,128 --context 2048 --prompts "" \
      --steps 20 --warmup 3 --out "$out" --name "roofline-$p-$kind" \
      > "$out/roofline-$p-$kind.log" 2> "$out/roofline-$p-$kind.err" || rc=$?
    grep -A8 "^decode forward" "$out/roofline-$p-$kind.log"
  done
done
exit $rc
