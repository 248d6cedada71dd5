// Paged decode attention (split-K, "flash decoding"): each sequence's single new query attends over
// its own KV rows read in place from the layer-major pool, by slot.
//
// Why: the torch decode path gathers every sequence's context out of the pool into a padded
// [2, B, S, KVH, HD] tensor per layer, then runs masked SDPA, which with grouped-query heads expands
// K/V per query head. On the 4B shape that moved several times the KV bytes per step and made a
// 32-stream step at 2k context ~29 ms (docs/benchmarks/decoder-qwen3-4b-shape-h200-graphs.json),
// over the 24 ms a 42 tok/s stream allows. Here the KV is read once: the cost is the bytes of the
// context, whatever the fragmentation (a slot is read as one row, like the hand-off kernels).
//
// Layout of the work: block (b, h, split) = one sequence b, one KV head h (its G query heads ride
// along, so K/V are read once per group), tokens [split * chunk, ...). Four warps stride over those
// tokens, U tokens per iteration with all their loads in flight; a lane holds HD/32 elements of a row,
// so a K row costs one vector load per lane and a score one warp reduction. Each warp keeps an online
// softmax (running max, sum, weighted V) in registers; the block merges its warps in shared memory and
// writes one partial per (head, split); a second kernel merges the splits. Scores use exp2 with the
// scale folded into q (scale * log2 e). Accumulation is float32 throughout; the output is q's dtype.
#include "decode_attention.h"
#include "cuda_check.h"
#include "decode_attention_common.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <stdexcept>
#include <string>

namespace tandem {
namespace {

using attn::from_float;
using attn::Pack;
using attn::to_float;

constexpr int kWarps = 4;
constexpr int kUnroll = 4;  // tokens per warp per iteration, their K and V loads issued together


template <typename T, int EPL, int G>
__global__ void __launch_bounds__(kWarps * 32)
    decode_partial(const T* __restrict__ q, const T* __restrict__ kv, int64_t pool_rows,
                   const int64_t* __restrict__ slots, int64_t s_max, const int64_t* __restrict__ lengths,
                   int kv_heads, int64_t chunk, int splits, float scale_log2, float* __restrict__ part_acc,
                   float* __restrict__ part_ml) {
  constexpr int HD = 32 * EPL;
  using P = Pack<T, EPL>;
  const auto [b, h, split, warp, lane, nh, len, t0, t1] = attn::split_block<G>(kv_heads, lengths, chunk);

  float qr[G][EPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const P p = *reinterpret_cast<const P*>(q + (static_cast<int64_t>(b) * nh + h * G + g) * HD + lane * EPL);
#pragma unroll
    for (int e = 0; e < EPL; ++e) qr[g][e] = to_float(p.v[e]) * scale_log2;
  }
  float m[G], l[G], acc[G][EPL];
  attn::init_state(m, l, acc);

  const int64_t row = static_cast<int64_t>(kv_heads) * HD;  // elements per slot of one of K / V
  const T* kbase = kv + static_cast<int64_t>(h) * HD + lane * EPL;
  const T* vbase = kbase + pool_rows * row;
  const int64_t* srow = slots + static_cast<int64_t>(b) * s_max;
  for (int64_t base = t0 + warp * kUnroll; base < t1; base += kWarps * kUnroll) {
    P kp[kUnroll], vp[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u < t1) {
        const int64_t slot = srow[base + u];
        kp[u] = *reinterpret_cast<const P*>(kbase + slot * row);
        vp[u] = *reinterpret_cast<const P*>(vbase + slot * row);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u >= t1) break;
      float kf[EPL], vf[EPL];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        kf[e] = to_float(kp[u].v[e]);
        vf[e] = to_float(vp[u].v[e]);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) s += qr[g][e] * kf[e];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        const float mn = fmaxf(m[g], s);
        const float corr = exp2f(m[g] - mn);  // 0 for the first token (m = -inf)
        const float p = exp2f(s - mn);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * corr + p * vf[e];
        m[g] = mn;
      }
    }
  }

  __shared__ float s_m[kWarps][G];
  __shared__ float s_l[kWarps][G];
  __shared__ float s_acc[kWarps][G][HD];
  attn::stash_warp_state<EPL, G, HD>(s_m, s_l, s_acc, warp, lane, m, l, acc);
  __syncthreads();
  attn::store_split_partial<kWarps, G, HD>(s_m, s_l, s_acc, b, nh, h, splits, split, part_acc, part_ml);
}

// Variant 2 (the default): the same work, mapped for fewer shuffles and no redundant exponentials.
// A warp takes 32 tokens at a time, one per lane: each lane computes its token's G scores against
// q held in shared memory (a K row read as 16-byte vectors), the warp then updates the online
// softmax once per tile (two reductions per head instead of a reduction per token), and for P.V the
// lanes switch to owning dimensions, taking each token's weight and slot from its lane by shuffle.
// Variant 1 above does a full warp reduction and an exponential in every lane for every token.
template <typename T, int EPL, int G>
__global__ void __launch_bounds__(kWarps * 32)
    decode_partial_tiles(const T* __restrict__ q, const T* __restrict__ kv, int64_t pool_rows,
                         const int64_t* __restrict__ slots, int64_t s_max, const int64_t* __restrict__ lengths,
                         int kv_heads, int64_t chunk, int splits, float scale_log2, float* __restrict__ part_acc,
                         float* __restrict__ part_ml) {
  constexpr int HD = 32 * EPL;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load of a K row
  constexpr int NV = HD / VEC;
  constexpr int kBatch = 8;  // V rows in flight per lane in P.V
  using P = Pack<T, EPL>;
  const auto [b, h, split, warp, lane, nh, len, t0, t1] = attn::split_block<G>(kv_heads, lengths, chunk);

  __shared__ __align__(16) float s_q[G][HD];
  for (int i = threadIdx.x; i < G * HD; i += kWarps * 32) {
    const int g = i / HD;
    s_q[g][i - g * HD] = to_float(q[(static_cast<int64_t>(b) * nh + h * G) * HD + i]) * scale_log2;
  }
  __syncthreads();

  float m[G], l[G], acc[G][EPL];
  attn::init_state(m, l, acc);
  const int64_t row = static_cast<int64_t>(kv_heads) * HD;
  const T* kbase = kv + static_cast<int64_t>(h) * HD;
  const T* vbase = kbase + pool_rows * row + lane * EPL;
  const int64_t* srow = slots + static_cast<int64_t>(b) * s_max;

  for (int64_t base = t0 + warp * 32; base < t1; base += kWarps * 32) {
    const int64_t t = base + lane;
    const bool valid = t < t1;
    const int64_t slot = valid ? srow[t] : 0;
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (valid) {
      const uint4* krow = reinterpret_cast<const uint4*>(kbase + slot * row);
#pragma unroll 4
      for (int c = 0; c < NV; ++c) {
        const uint4 raw = krow[c];
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float kf = to_float(e[i]);
#pragma unroll
          for (int g = 0; g < G; ++g) s[g] += s_q[g][c * VEC + i] * kf;
        }
      }
    }
    float p[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float sg = valid ? s[g] : -INFINITY;
      float tmax = sg;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
      const float mn = fmaxf(m[g], tmax);  // finite: lane 0's token is always valid
      const float corr = exp2f(m[g] - mn);
      p[g] = valid ? exp2f(sg - mn) : 0.f;
      float psum = p[g];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      l[g] = l[g] * corr + psum;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
      m[g] = mn;
    }
    const int n = t1 - base < 32 ? static_cast<int>(t1 - base) : 32;
    for (int j0 = 0; j0 < n; j0 += kBatch) {
      P vp[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int64_t sj = __shfl_sync(0xffffffffu, slot, (j0 + u) & 31);
        if (j0 + u < n) vp[u] = *reinterpret_cast<const P*>(vbase + sj * row);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float pj = __shfl_sync(0xffffffffu, p[g], (j0 + u) & 31);
          if (j0 + u < n) {
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] += pj * to_float(vp[u].v[e]);
          }
        }
      }
    }
  }

  __shared__ float s_m[kWarps][G];
  __shared__ float s_l[kWarps][G];
  __shared__ float s_acc[kWarps][G][HD];
  attn::stash_warp_state<EPL, G, HD>(s_m, s_l, s_acc, warp, lane, m, l, acc);
  __syncthreads();
  attn::store_split_partial<kWarps, G, HD>(s_m, s_l, s_acc, b, nh, h, splits, split, part_acc, part_ml);
}


// Variants 1 and 2 keep their own merge (one split after the other, as measured with them); variant 3
// uses attn::decode_merge, whose loads of several splits are in flight together. One block per
// (sequence, query head), one thread per element of the head.
template <typename T>
__global__ void decode_merge_serial(const float* __restrict__ part_acc, const float* __restrict__ part_ml, int splits,
                             int head_dim, T* __restrict__ out) {
  const int64_t head = blockIdx.x;
  const int d = threadIdx.x;
  const float* ml = part_ml + head * splits * 2;
  float mx = -INFINITY;
  for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[2 * s]);
  float sum = 0.f, a = 0.f;
  if (mx != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      if (ml[2 * s] == -INFINITY) continue;
      const float f = exp2f(ml[2 * s] - mx);
      sum += ml[2 * s + 1] * f;
      a += part_acc[(head * splits + s) * head_dim + d] * f;
    }
  }
  out[head * head_dim + d] = from_float<T>(sum > 0.f ? a / sum : 0.f);
}

template <typename T, int EPL, int G>
void launch(int variant, const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
            const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
            float* part_acc, float* part_ml, void* out, cudaStream_t stream) {
  const float scale_log2 = scale * 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>(batch * kv_heads), static_cast<unsigned>(splits));
  if (variant == 1) {
    decode_partial<T, EPL, G><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(kv), pool_rows, slots, s_max, lengths,
        static_cast<int>(kv_heads), chunk, splits, scale_log2, part_acc, part_ml);
  } else {
    decode_partial_tiles<T, EPL, G><<<grid, kWarps * 32, 0, stream>>>(
        static_cast<const T*>(q), static_cast<const T*>(kv), pool_rows, slots, s_max, lengths,
        static_cast<int>(kv_heads), chunk, splits, scale_log2, part_acc, part_ml);
  }
  check(cudaGetLastError(), "decode_partial launch");
  decode_merge_serial<T><<<static_cast<unsigned>(batch * kv_heads * G), 32 * EPL, 0, stream>>>(
      part_acc, part_ml, splits, 32 * EPL, static_cast<T*>(out));
  check(cudaGetLastError(), "decode_merge launch");
}

template <typename T, int EPL>
bool by_group(int variant, int64_t group, const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
              const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
              float* part_acc, float* part_ml, void* out, cudaStream_t stream) {
  switch (group) {
    case 1:
      launch<T, EPL, 1>(variant, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, part_acc,
                        part_ml, out, stream);
      return true;
    case 2:
      launch<T, EPL, 2>(variant, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, part_acc,
                        part_ml, out, stream);
      return true;
    case 4:
      launch<T, EPL, 4>(variant, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, part_acc,
                        part_ml, out, stream);
      return true;
    case 8:
      launch<T, EPL, 8>(variant, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, part_acc,
                        part_ml, out, stream);
      return true;
    default:
      return false;
  }
}

template <typename T>
bool by_head_dim(int variant, int64_t head_dim, int64_t group, const void* q, const void* kv, int64_t pool_rows,
                 const int64_t* slots, int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads,
                 float scale, int64_t chunk, int splits, float* part_acc, float* part_ml, void* out,
                 cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return by_group<T, 2>(variant, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, stream);
    case 128:
      return by_group<T, 4>(variant, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, stream);
    case 256:
      return by_group<T, 8>(variant, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, stream);
    default:
      return false;
  }
}

}  // namespace

bool decode_attention_supported(int dtype, int64_t head_dim, int64_t group, int variant, bool kv_fp8) {
  if (kv_fp8) return (variant == 4 || variant == 5) && mma_fp8_supported(dtype, head_dim, group);
  if (variant >= 3 && variant <= 5) return staged_supported(dtype, head_dim, group);
  return (variant == 1 || variant == 2) && dtype >= 0 && dtype <= 2 &&
         (head_dim == 64 || head_dim == 128 || head_dim == 256) && (group == 1 || group == 2 || group == 4 || group == 8);
}

void decode_attention(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
                      const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim,
                      int dtype, float scale, int64_t chunk, float* part_acc, float* part_ml, void* out,
                      int device, cudaStream_t stream, int variant, const float* kv_scales) {
  if (variant < 1 || variant > 5) throw std::runtime_error("decode_attention: variant must be 1..5");
  if (!decode_attention_supported(dtype, head_dim, group, variant, kv_scales != nullptr)) {
    throw std::runtime_error("decode_attention: no kernel for dtype " + std::to_string(dtype) + ", head_dim " +
                             std::to_string(head_dim) + ", group " + std::to_string(group) + ", variant " +
                             std::to_string(variant) + (kv_scales != nullptr ? ", E4M3 KV" : ""));
  }
  if (batch <= 0 || kv_heads <= 0 || s_max <= 0 || chunk <= 0) {
    throw std::runtime_error("decode_attention: batch, kv_heads, s_max and chunk must be positive");
  }
  const int64_t splits = (s_max + chunk - 1) / chunk;
  if (splits > 65535 || batch * kv_heads > 0x7fffffff) {
    throw std::runtime_error("decode_attention: grid too large (lower s_max or raise chunk)");
  }
  on_device(device, [&] {
    const int n = static_cast<int>(splits);
    if (variant == 4 || variant == 5) {
      decode_attention_mma(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, group, head_dim, dtype, scale,
                           chunk, n, part_acc, part_ml, out, device, stream, variant, kv_scales);
    } else if (variant == 3) {
      decode_attention_staged(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, group, head_dim, dtype, scale,
                              chunk, n, part_acc, part_ml, out, device, stream);
    } else {
      switch (dtype) {
      case 0:
        by_head_dim<float>(variant, head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk,
                           n, part_acc, part_ml, out, stream);
        break;
      case 1:
        by_head_dim<__half>(variant, head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                            chunk, n, part_acc, part_ml, out, stream);
        break;
      default:
        by_head_dim<__nv_bfloat16>(variant, head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads,
                                   scale, chunk, n, part_acc, part_ml, out, stream);
      }
    }
  });
}

}  // namespace tandem
