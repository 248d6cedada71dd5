// Pieces shared by the paged decode-attention kernels (decode_attention_mma.cu: the default;
// decode_attention_staged.cu: its fallback; decode_attention.cu dispatches between them): element
// conversions, a lane's vector of a row, the end of a split's block (`store_split_partial`) and the
// kernel that merges the split-K partials. Device code only; each includer instantiates what it uses
// (gemv.cu takes the element conversions).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace tandem {
namespace attn {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// EPL elements of one lane, loaded as one (or, for 32 bytes, two) vector loads.
template <typename T, int EPL>
struct alignas(EPL * sizeof(T) >= 16 ? 16 : EPL * sizeof(T)) Pack {
  T v[EPL];
};

// cp.async (sm_80+): a 16-byte global -> shared copy that does not pass through registers; copies
// are grouped by commit and waited for by group (wait<N>: all but the N most recent groups done).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Copy rows of n (<= 32) tokens, lane t holding token t's slot, into shared rows of `stride` bytes
// (cp.async); lane i copies pieces i, i + 32, ... so each warp copy is whole consecutive rows.
// `zero_rest`: the pieces of rows n..31 are zeroed instead of left as they were. One group committed.
template <int CH>
__device__ __forceinline__ void load_tile(unsigned char* dst, int stride, const unsigned char* src, int64_t pool_row,
                                          int64_t slot, int n, int lane, bool zero_rest) {
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int i = lane + 32 * k;
    const int r = i / CH;
    const int c = i - r * CH;
    const int64_t s = __shfl_sync(0xffffffffu, slot, r);
    if (r < n) {
      cp_async16(dst + r * stride + c * 16, src + s * pool_row + c * 16);
    } else if (zero_rest) {
      *reinterpret_cast<uint4*>(dst + r * stride + c * 16) = make_uint4(0, 0, 0, 0);
    }
  }
  cp_async_commit();
}

// Where a block of the staged kernel works: sequence b and KV head h (blockIdx.x), split (blockIdx.y),
// its warp and lane, the query heads nh, and the split's tokens [t0, t1) of the sequence's len.
struct SplitBlock {
  int b, h, split, warp, lane, nh;
  int64_t len, t0, t1;
};
template <int G>
__device__ __forceinline__ SplitBlock split_block(int kv_heads, const int64_t* __restrict__ lengths, int64_t chunk) {
  const int b = blockIdx.x / kv_heads;
  const int h = blockIdx.x - b * kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int nh = kv_heads * G;
  const int64_t len = lengths[b];
  const int64_t t0 = static_cast<int64_t>(split) * chunk;
  const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
  return {b, h, split, warp, lane, nh, len, t0, t1};
}

// An empty online-softmax state per query head: max -inf, sum 0, output 0 (EPL elements a lane).
template <int G, int EPL>
__device__ __forceinline__ void init_state(float (&m)[G], float (&l)[G], float (&acc)[G][EPL]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  }
}

// The end of a split's block: its NW warps each hold an online-softmax state per query head of the
// group in shared memory (s_m: max, s_l: sum, s_acc: unnormalised output); every thread of the block
// merges them into the split's partial of each of the G heads (part_acc [.., splits, HD], part_ml
// [.., splits, 2]: max and sum), which decode_merge combines. A warp that saw no token holds max =
// -inf and weighs 0. Call after the __syncthreads() that follows the states' last write.
template <int NW, int G, int HD>
__device__ __forceinline__ void store_split_partial(const float (*s_m)[G], const float (*s_l)[G],
                                                    const float (*s_acc)[G][HD], int b, int nh, int h,
                                                    int splits, int split, float* __restrict__ part_acc,
                                                    float* __restrict__ part_ml) {
  for (int i = threadIdx.x; i < G * HD; i += NW * 32) {
    const int g = i / HD;
    const int d = i - g * HD;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, s_m[w][g]);
    float sum = 0.f, a = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = s_m[w][g] == -INFINITY ? 0.f : exp2f(s_m[w][g] - mx);
        sum += s_l[w][g] * f;
        a += s_acc[w][g][d] * f;
      }
    }
    const int64_t at = (static_cast<int64_t>(b) * nh + h * G + g) * splits + split;
    part_acc[at * HD + d] = a;
    if (d == 0) {
      part_ml[at * 2] = mx;
      part_ml[at * 2 + 1] = sum;
    }
  }
}

// The staged kernel: warp `warp`'s state (m, l per head; acc: EPL elements of each head's output per lane)
// into the shared arrays `store_split_partial` reads.
template <int EPL, int G, int HD>
__device__ __forceinline__ void stash_warp_state(float (*s_m)[G], float (*s_l)[G], float (*s_acc)[G][HD], int warp,
                                                 int lane, const float (&m)[G], const float (&l)[G],
                                                 const float (&acc)[G][EPL]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      s_m[warp][g] = m[g];
      s_l[warp][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < EPL; ++e) s_acc[warp][g][lane * EPL + e] = acc[g][e];
  }
}

// One block per (sequence, query head), one thread per element of the head: merge the splits.
// Partials of empty splits hold m = -inf and weigh 0 (exp2(-inf) = 0); split 0 is never empty
// (lengths >= 1), so the maximum is finite. The loops are unrolled so a thread's loads of several
// splits are in flight together: at batch 1 a head has 16-64 splits and the merge was latency-bound.
template <typename T>
__global__ void decode_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml, int splits,
                             int head_dim, T* __restrict__ out) {
  const int64_t head = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = part_ml + head * splits * 2;
  const float* acc = part_acc + head * splits * head_dim + d;
  float mx = -INFINITY;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float sum = 0.f, a = 0.f;
#pragma unroll 8
  for (int s = 0; s < splits; ++s) {
    const float f = exp2f(ml[2 * s] - mx);
    sum += ml[2 * s + 1] * f;
    a += acc[static_cast<int64_t>(s) * head_dim] * f;
  }
  out[head * head_dim + d] = from_float<T>(sum > 0.f ? a / sum : 0.f);
}

}  // namespace attn

// The default kernel (decode_attention_mma.cu): the staged kernel's tiles with the scores and P.V on the
// tensor cores (mma.sync m16n8k16, float32 accumulation) for float16/bfloat16 and head_dim 64/128; other
// shapes run the staged kernel. A block per (sequence, KV head, split), four warps over the split's
// tiles. Same arguments and contract as `decode_attention_staged`, plus `kv_scales` (see decode_attention.h).
// `kv_scales` (nullptr: KV in q's dtype) float32 [2, KVH], the layer's K then V scales of an E4M3 KV.
void decode_attention_mma(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
                          const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim,
                          int dtype, float scale, int64_t chunk, int splits, float* part_acc, float* part_ml,
                          void* out, int device, cudaStream_t stream, const float* kv_scales);
// Whether the default kernel takes E4M3 KV for this q dtype, head dim and group.
bool mma_fp8_supported(int dtype, int64_t head_dim, int64_t group);

// The fallback kernel (decode_attention_staged.cu): K and V tiles staged through shared memory by cp.async.
// Same arguments as `decode_attention`; `group` 1..8. Throws std::runtime_error on an unsupported
// shape. Runs on the current device (the caller has set it).
bool staged_supported(int dtype, int64_t head_dim, int64_t group);
void decode_attention_staged(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots,
                             int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group,
                             int64_t head_dim, int dtype, float scale, int64_t chunk, int splits, float* part_acc,
                             float* part_ml, void* out, int device, cudaStream_t stream);

}  // namespace tandem
