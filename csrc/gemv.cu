// Small-batch linear layer: y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]) for M = 1..8 rows, float16/bfloat16,
// float32 accumulation (the decode step's projections at small batch).
//
// Why: at batch 1 a decode step is its weights read once (8 GB for the 4B shape), and cuBLAS's kernels for
// these shapes read them at ~68 % of HBM (tandem-bench-decoder's kernel-family breakdown), with a split-K reduction kernel after
// some of them. This is the memory-bound form: a warp per R weight rows, each lane streaming 16-byte
// vectors of its rows (8 vectors in flight a lane: R rows x U = 8 / R steps), x read through L1 (every
// warp of a block reads the same x), the lanes' partial dot products reduced by shuffles. R is picked
// per shape so the grid holds enough warps to keep every SM's loads in flight (launch below).
// Weights are loaded with L1::no_allocate so they do not evict x. One kernel, no workspace, no host
// synchronisation: CUDA-graph safe.
#include "cuda_check.h"
#include "decode_attention_common.cuh"  // attn::to_float / from_float
#include "gemv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <stdexcept>
#include <string>

namespace tandem {
namespace {

constexpr int kWarps = 8;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float2 pair(unsigned v, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
__device__ __forceinline__ float2 pair(unsigned v, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <typename T>
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  const unsigned* pa = reinterpret_cast<const unsigned*>(&a);
  const unsigned* pb = reinterpret_cast<const unsigned*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = pair(pa[i], T());
    const float2 fb = pair(pb[i], T());
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}

// The mapping both kernels share: warp (blockIdx.x, warp) takes R weight rows from row0 (rows past n
// repeat row n - 1; their sums are not stored), each lane streams its 16-byte vectors of them (`kv` a
// row, U = 8 / R in flight, L1::no_allocate), and `dot(wv, m, c, kv, acc)` adds weight vector c of a
// row times row m of x to acc. On return every lane holds every (m, r) sum (shuffle reduction); lane
// m * R + r then stores output (m, row0 + r) through `store(m, row, sum)`.
template <int M, int R, typename W, typename Dot, typename Store>
__device__ __forceinline__ void stream_rows(const W* __restrict__ w, int n, int k, Dot dot, Store store) {
  constexpr int U = 8 / R;  // 16-byte steps a lane loads per row before it multiplies
  const int lane = threadIdx.x & 31;
  const int row0 = (blockIdx.x * kWarps + (threadIdx.x >> 5)) * R;
  if (row0 >= n) return;
  const int kv = k / (16 / static_cast<int>(sizeof(W)));  // 16-byte vectors per row
  const uint4* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r < n ? row0 + r : n - 1;
    wrow[r] = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row) * k);
  }
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.f;
  }
  for (int c0 = lane; c0 < kv; c0 += 32 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
#pragma unroll
      for (int r = 0; r < R; ++r) wv[u][r] = c < kv ? ld_stream(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c < kv) {
#pragma unroll
        for (int m = 0; m < M; ++m) dot(wv[u], m, c, kv, acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc[m][r] += __shfl_xor_sync(0xffffffffu, acc[m][r], off);
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int row = row0 + r;
      if (lane == m * R + r && row < n) store(m, row, acc[m][r]);
    }
  }
}

template <typename T, int M, int R>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_kernel(const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias, T* __restrict__ y,
                int n, int k) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  stream_rows<M, R>(
      w, n, k,
      [&](const uint4 (&wv)[R], int m, int c, int kv, float (&acc)[R]) {
        const uint4 xm = __ldg(xv + static_cast<int64_t>(m) * kv + c);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = dot8<T>(wv[r], xm, acc[r]);
      },
      [&](int m, int row, float sum) {
        const float b = bias == nullptr ? 0.f : attn::to_float<T>(bias[row]);
        y[static_cast<int64_t>(m) * n + row] = attn::from_float<T>(sum + b);
      });
}

// y = (x . W8^T) * scale + bias with W8 E4M3 [N, K] and one float32 scale per output row
// (tandem.model.dtype=fp8 at small batch: the weights' bytes halve and x stays bfloat16, so no
// activation is quantised). Same mapping as gemv_kernel; a lane's 16-byte vector is 16 weights, which
// meet 16 elements of x (two 16-byte loads), each pair converted E4M3 -> float16 -> float32 (exact).
__device__ __forceinline__ float dot16_fp8(const uint4& w, const uint4& xa, const uint4& xb, float acc) {
  const unsigned pw[4] = {w.x, w.y, w.z, w.w};
  const unsigned px[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pw[i] & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pw[i] >> 16), __NV_E4M3);
    const float2 w0 = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 w1 = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    const float2 x0 = pair(px[2 * i], __nv_bfloat16());
    const float2 x1 = pair(px[2 * i + 1], __nv_bfloat16());
    acc = fmaf(w0.x, x0.x, acc);
    acc = fmaf(w0.y, x0.y, acc);
    acc = fmaf(w1.x, x1.x, acc);
    acc = fmaf(w1.y, x1.y, acc);
  }
  return acc;
}

template <int M, int R>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_fp8_kernel(const __nv_bfloat16* __restrict__ x, const unsigned char* __restrict__ w,
                    const float* __restrict__ scale, const __nv_bfloat16* __restrict__ bias,
                    __nv_bfloat16* __restrict__ y, int n, int k) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);  // row m: 2 * kv vectors of 8
  stream_rows<M, R>(
      w, n, k,
      [&](const uint4 (&wv)[R], int m, int c, int kv, float (&acc)[R]) {
        const uint4 xa = __ldg(xv + static_cast<int64_t>(m) * 2 * kv + 2 * c);
        const uint4 xb = __ldg(xv + static_cast<int64_t>(m) * 2 * kv + 2 * c + 1);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = dot16_fp8(wv[r], xa, xb, acc[r]);
      },
      [&](int m, int row, float sum) {
        const float b = bias == nullptr ? 0.f : __bfloat162float(bias[row]);
        y[static_cast<int64_t>(m) * n + row] = __float2bfloat16_rn(sum * scale[row] + b);
      });
}

// Rows per warp: as many as still leave ~16 warps an SM (a warp keeps 8 x 16 bytes a lane in flight,
// ~4 KiB); the fewer rows a warp, the more often it rereads x (from L1).
int rows_per_warp(int64_t n, int sms) {
  const int64_t want = static_cast<int64_t>(sms) * 16;
  if (n / 4 >= want) return 4;
  if (n / 2 >= want) return 2;
  return 1;
}

template <typename T, int M, int R>
void launch_rows(const void* x, const void* w, const void* bias, void* y, int64_t n, int64_t k, cudaStream_t stream) {
  const int64_t warps = (n + R - 1) / R;
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  gemv_kernel<T, M, R><<<blocks, kWarps * 32, 0, stream>>>(static_cast<const T*>(x), static_cast<const T*>(w),
                                                            static_cast<const T*>(bias), static_cast<T*>(y),
                                                            static_cast<int>(n), static_cast<int>(k));
  check(cudaGetLastError(), "gemv launch");
}

template <int M, int R>
void launch_rows_fp8(const void* x, const void* w, const float* scale, const void* bias, void* y, int64_t n,
                     int64_t k, cudaStream_t stream) {
  const int64_t warps = (n + R - 1) / R;
  const unsigned blocks = static_cast<unsigned>((warps + kWarps - 1) / kWarps);
  gemv_fp8_kernel<M, R><<<blocks, kWarps * 32, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const unsigned char*>(w), scale,
      static_cast<const __nv_bfloat16*>(bias), static_cast<__nv_bfloat16*>(y), static_cast<int>(n),
      static_cast<int>(k));
  check(cudaGetLastError(), "gemv_fp8 launch");
}

// `scale` nullptr: T weights (gemv_kernel); else E4M3 weights at per-row scales (T is bfloat16).
template <typename T, int M>
void launch_m(const void* x, const void* w, const float* scale, const void* bias, void* y, int64_t n, int64_t k,
              int sms, cudaStream_t stream) {
  const int rows = rows_per_warp(n, sms);
  if (scale != nullptr) {
    if (rows == 4) return launch_rows_fp8<M, 4>(x, w, scale, bias, y, n, k, stream);
    if (rows == 2) return launch_rows_fp8<M, 2>(x, w, scale, bias, y, n, k, stream);
    return launch_rows_fp8<M, 1>(x, w, scale, bias, y, n, k, stream);
  }
  switch (rows) {
    case 4:
      return launch_rows<T, M, 4>(x, w, bias, y, n, k, stream);
    case 2:
      return launch_rows<T, M, 2>(x, w, bias, y, n, k, stream);
    default:
      return launch_rows<T, M, 1>(x, w, bias, y, n, k, stream);
  }
}

template <typename T>
void launch(int64_t m, const void* x, const void* w, const float* scale, const void* bias, void* y, int64_t n,
            int64_t k, int sms, cudaStream_t stream) {
#define TANDEM_GEMV_M(V)                                          \
  case V:                                                         \
    return launch_m<T, V>(x, w, scale, bias, y, n, k, sms, stream);
  switch (m) {
    TANDEM_GEMV_M(1)
    TANDEM_GEMV_M(2)
    TANDEM_GEMV_M(3)
    TANDEM_GEMV_M(4)
    TANDEM_GEMV_M(5)
    TANDEM_GEMV_M(6)
    TANDEM_GEMV_M(7)
    TANDEM_GEMV_M(8)
    default:
      throw std::runtime_error("gemv: rows " + std::to_string(m) + " not in 1.." + std::to_string(kGemvMaxRows));
  }
#undef TANDEM_GEMV_M
}

}  // namespace

void gemv(const void* x, const void* w, const void* bias, void* y, int64_t m, int64_t n, int64_t k, int dtype,
          int device, cudaStream_t stream, const float* w_scale) {
  const int64_t vec = w_scale != nullptr ? 16 : 8;
  if (k % vec != 0 || k <= 0 || n <= 0 || n > 0x7fffffff || k > 0x7fffffff) {
    throw std::runtime_error("gemv: need k > 0 a multiple of " + std::to_string(vec) + " and 0 < n < 2^31, got n " +
                             std::to_string(n) + ", k " + std::to_string(k));
  }
  if (w_scale != nullptr && dtype != 2) throw std::runtime_error("gemv: E4M3 weights take bfloat16 x (dtype 2)");
  on_device(device, [&] {
    const int sms = sm_count(device);
    if (dtype == 1) {
      launch<__half>(m, x, w, nullptr, bias, y, n, k, sms, stream);
    } else if (dtype == 2) {
      launch<__nv_bfloat16>(m, x, w, w_scale, bias, y, n, k, sms, stream);
    } else {
      throw std::runtime_error("gemv: dtype " + std::to_string(dtype) + " is not float16 (1) or bfloat16 (2)");
    }
  });
}

}  // namespace tandem
