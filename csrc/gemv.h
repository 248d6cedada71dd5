// Small-batch linear layer (gemv.cu): y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) in float16 or bfloat16 with
// float32 accumulation, for 1 <= M <= kGemvMaxRows.
//
// Contract: x [M, K], w [N, K] (a torch Linear's weight), bias [N] or nullptr and y [M, N] are contiguous
// device tensors of `device` in one dtype (1 float16, 2 bfloat16), 16-byte aligned, K a multiple of 8.
// The caller (csrc/linear.py) checks all of that; here only M, N, K and dtype are, and a violation throws
// std::runtime_error. One kernel on `stream`, no synchronisation, no workspace (CUDA-graph safe); y is
// written whole. Numerics: each output is one float32 dot product rounded once to the dtype, as cuBLAS's
// (the order of the additions differs, so results agree to the dtype's rounding, not bit for bit).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tandem {

constexpr int kGemvMaxRows = 8;

// `w_scale` (default nullptr): w is E4M3 [N, K] (K a multiple of 16) and y = (x . w^T) * w_scale[n] +
// bias[n], x, bias and y bfloat16 (tandem.model.dtype=fp8 at small batch).
void gemv(const void* x, const void* w, const void* bias, void* y, int64_t m, int64_t n, int64_t k, int dtype,
          int device, cudaStream_t stream, const float* w_scale = nullptr);

}  // namespace tandem
