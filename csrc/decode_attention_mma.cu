// Paged decode attention, the default kernel (float16/bfloat16, head_dim 64/128, and E4M3 KV): the staged
// kernel's cp.async staging of K and V tiles (decode_attention_staged.cu), with the arithmetic on the
// tensor cores.
//
// Why: the staged kernel streams KV at ~67 % of HBM at 64 x 2048 (ncu, H200) while its SMs issue an
// instruction every ~1.5 cycles: each lane's 512 FMAs per token come with shared-memory reads of q,
// conversions and shuffles, and that issue rate, not memory, bounds it. Here one warp instruction
// (mma.sync m16n8k16) does 2,048 multiply-adds: the G query heads of a KV head are the rows of the
// A operand (padded to 16 with zeros), 8 tokens the columns of B, so a 32-token tile costs 32 mma for
// the scores and 32 for P.V instead of ~1,000 FMA instructions, and the issue slots go to moving bytes.
//
// Per warp and 32-token tile (flash-attention 2's register reuse):
//   S[16 heads x 8 tokens] = Q[16 x 16] . K^T[16 x 8], accumulated over head_dim/16 k-steps; B comes
//     from the K tile in shared memory by ldmatrix (rows = tokens, as the pool stores them);
//   online softmax on the S fragments (a row is spread over a quad of lanes: two shuffles per max);
//   O[16 heads x 8 dims] += P[16 x 16 tokens] . V[16 tokens x 8 dims]: P's A fragments are the S
//     accumulators rounded to the input type, V's B fragments come by ldmatrix.trans.
// Shared-memory rows (K and V) are padded by 16 bytes so ldmatrix's eight row reads hit distinct banks.
// Tokens past a sequence's length get score -inf; their V rows are zero-filled (P = 0 must not meet a
// stale NaN). Float32 accumulation throughout; q is used unscaled (exact), the scores are scaled by
// scale * log2 e in float32. Rows of O past the group are computed on zero queries and never stored.
//
// E4M3 KV (`kv_scales` given; tandem.kv.dtype=fp8): the pool holds K and V as float8_e4m3fn with one
// power-of-two scale per (K or V, KV head) of the layer. cp.async stages a tile's E4M3 rows (half the
// bytes), each lane converts 16 of them at a time to float16 (cvt.rn.f16x2.e4m3x2: exact, E4M3 is a
// subset of float16) into the same padded tiles the 16-bit path reads, and the tile then runs the
// float16 mma (q rounded from bf16 to float16 once: exact for |q| in [2^-14, 65504]). K's scale
// rides on the score scale, V's on the partial output, so no element is multiplied by its scale.
// Why convert in shared memory rather than in the B fragments: ldmatrix.trans then gives V's
// fragments as for 16-bit KV, and the arithmetic and softmax stay the code the 16-bit path proved.
#include "cuda_check.h"
#include "decode_attention_common.cuh"

#include <cuda_fp8.h>

#include <stdexcept>
#include <string>
#include <type_traits>

namespace tandem {
namespace {

using attn::cp_async16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::load_tile;

constexpr int kTile = 32;
constexpr int kWarps = 4;

template <int HD, bool F8 = false>
struct MGeo {
  static constexpr int kRowBytes = HD * 2;  // a 16-bit tile row
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kStride = kRowBytes + 16;
  static constexpr int kTileBytes = 2 * kTile * kStride;  // K tile, then V tile
  static constexpr int kRow8 = HD;                        // an E4M3 row in the pool and its staging
  static constexpr int kChunks8 = HD / 16;
  static constexpr int kStageBytes = F8 ? 2 * kTile * kRow8 : 0;  // E4M3 K staging, then V's
  static constexpr int kWarpBytes = kTileBytes + kStageBytes;
  static constexpr int kSmem = kWarps * kWarpBytes;
};

// The 16-bit type the tiles and the mma hold: T itself, float16 for E4M3 KV.
template <typename T, bool F8>
using MmaT = std::conditional_t<F8, __half, T>;

// Two consecutive elements of q as the A fragment's 32-bit register, in the mma's type.
template <typename T, typename M>
__device__ __forceinline__ unsigned q_pair(const T* p) {
  if constexpr (std::is_same_v<T, M>) {
    return *reinterpret_cast<const unsigned*>(p);
  } else {
    const __half2 h = __floats2half2_rn(attn::to_float(p[0]), attn::to_float(p[1]));
    return *reinterpret_cast<const unsigned*>(&h);
  }
}

// An E4M3 tile in shared memory (rows of HD bytes) -> the float16 tile (rows of `stride` bytes): lane
// i converts 16-byte pieces i, i + 32, ...; rows >= n are zero-filled when `zero_rest` (V: P = 0 must
// not meet a stale NaN) or left alone (K: their scores are masked to -inf).
template <int HD>
__device__ __forceinline__ void convert_tile(unsigned char* dst, int stride, const unsigned char* stage, int n,
                                             int lane, bool zero_rest) {
  constexpr int CH = HD / 16;
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int i = lane + 32 * k;
    const int r = i / CH;
    const int c = i - r * CH;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (r < n) {
      const uint4 raw = *reinterpret_cast<const uint4*>(stage + r * HD + c * 16);
      const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
      unsigned h[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[j] & 0xffffu), __NV_E4M3);
        const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w[j] >> 16), __NV_E4M3);
        h[2 * j] = static_cast<unsigned>(a.x) | (static_cast<unsigned>(a.y) << 16);
        h[2 * j + 1] = static_cast<unsigned>(b.x) | (static_cast<unsigned>(b.y) << 16);
      }
      lo = make_uint4(h[0], h[1], h[2], h[3]);
      hi = make_uint4(h[4], h[5], h[6], h[7]);
    } else if (!zero_rest) {
      continue;
    }
    *reinterpret_cast<uint4*>(dst + r * stride + c * 32) = lo;
    *reinterpret_cast<uint4*>(dst + r * stride + c * 32 + 16) = hi;
  }
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// One warp's share of split `split` of sequence b for KV head h: the 32-token tiles first, first +
// step, ... of the split, staged through this warp's K and V tiles (s_k, then s_v = s_k + a tile). On
// return o holds the un-normalised P.V of query row gid (and gid + 8, padding), m0 its running maximum
// and l0 its sum of exp2 over the quad (reduced: every lane of a quad has it). A warp with no tile
// (a split past the sequence's length) returns m0 = -inf, l0 = 0, o = 0.
template <typename T, int HD, int G, bool F8>
__device__ __forceinline__ void warp_attend(const T* __restrict__ q, const void* __restrict__ kv, int64_t pool_rows,
                                            const int64_t* __restrict__ slots, int64_t s_max,
                                            const int64_t* __restrict__ lengths, int kv_heads, int64_t chunk, int b,
                                            int h, int split, int first, int step, unsigned char* s_k,
                                            float scale_log2, const float* __restrict__ kv_scales, int lane,
                                            float (&o)[HD / 8][4], float& m0, float& l0) {
  using GT = MGeo<HD, F8>;
  using M = MmaT<T, F8>;
  constexpr int KS = HD / 16;  // k-steps of the scores
  constexpr int DT = HD / 8;   // n-tiles of O
  const int gid = lane >> 2;   // the row (query head) this lane's fragments hold
  const int tig = lane & 3;
  const int64_t len = lengths[b];
  const int64_t t0 = static_cast<int64_t>(split) * chunk;
  const int64_t t1 = t0 + chunk < len ? t0 + chunk : len;
  // Bytes of one pool row (a slot's K or V over every KV head) and of this head's piece of it.
  constexpr int kHeadBytes = F8 ? GT::kRow8 : GT::kRowBytes;
  const int64_t pool_row = static_cast<int64_t>(kv_heads) * kHeadBytes;
  const unsigned char* kbase = reinterpret_cast<const unsigned char*>(kv) + static_cast<int64_t>(h) * kHeadBytes;
  const unsigned char* vbase = kbase + pool_rows * pool_row;
  const int64_t* srow = slots + static_cast<int64_t>(b) * s_max;
  const T* qrow = q + (static_cast<int64_t>(b) * kv_heads * G + h * G + (gid < G ? gid : 0)) * HD;
  unsigned char* s_v = s_k + kTile * GT::kStride;
  unsigned char* st_k = s_k + GT::kTileBytes;  // E4M3 staging (F8 only)
  unsigned char* st_v = st_k + kTile * GT::kRow8;
  if constexpr (F8) scale_log2 *= kv_scales[h];
  int64_t base = t0 + first;

  int n = t1 - base >= kTile ? kTile : (t1 > base ? static_cast<int>(t1 - base) : 0);
  int64_t slot = lane < n ? srow[base + lane] : 0;
  if constexpr (F8) {
    load_tile<GT::kChunks8>(st_k, GT::kRow8, kbase, pool_row, slot, n, lane, false);
    load_tile<GT::kChunks8>(st_v, GT::kRow8, vbase, pool_row, slot, n, lane, false);
  } else {
    load_tile<GT::kChunks>(s_k, GT::kStride, kbase, pool_row, slot, n, lane, false);
    load_tile<GT::kChunks>(s_v, GT::kStride, vbase, pool_row, slot, n, lane, true);
  }

  // Q's A fragments: row gid (< G) of the group, rows gid + 8 are zero padding.
  unsigned qa[KS][2];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    qa[ks][0] = gid < G ? q_pair<T, M>(qrow + ks * 16 + 2 * tig) : 0u;
    qa[ks][1] = gid < G ? q_pair<T, M>(qrow + ks * 16 + 8 + 2 * tig) : 0u;
  }
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  m0 = -INFINITY;
  l0 = 0.f;
  float m1 = -INFINITY, l1 = 0.f;  // row gid + 8 (padding)

  // ldmatrix row addresses: lane i feeds row i % 8 of matrix i / 8.
  const int mrow = lane & 7;
  const int mat = lane >> 3;
  const unsigned k_addr = smem_u32(s_k + mrow * GT::kStride + mat * 16);
  const unsigned v_addr = smem_u32(s_v + ((mat & 1) * 8 + mrow) * GT::kStride + (mat >> 1) * 16);

  for (; base < t1; base += step) {
    const int64_t next = base + step;
    const int nn = t1 - next >= kTile ? kTile : (t1 > next ? static_cast<int>(t1 - next) : 0);
    const int64_t nslot = lane < nn ? srow[next + lane] : 0;

    cp_async_wait<1>();
    __syncwarp();
    if constexpr (F8) {  // this tile's K to float16, then the staging takes the next tile's K
      convert_tile<HD>(s_k, GT::kStride, st_k, n, lane, false);
      __syncwarp();
      load_tile<GT::kChunks8>(st_k, GT::kRow8, kbase, pool_row, nslot, nn, lane, false);
    }
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int k2 = 0; k2 < KS / 2; ++k2) {
        unsigned r0, r1, r2, r3;
        ldsm_x4(k_addr + nt * 8 * GT::kStride + k2 * 64, r0, r1, r2, r3);
        const unsigned a0[4] = {qa[2 * k2][0], 0u, qa[2 * k2][1], 0u};
        const unsigned a1[4] = {qa[2 * k2 + 1][0], 0u, qa[2 * k2 + 1][1], 0u};
        mma<M>(s[nt], a0, r0, r1);
        mma<M>(s[nt], a1, r2, r3);
      }
    }
    __syncwarp();
    if constexpr (!F8) load_tile<GT::kChunks>(s_k, GT::kStride, kbase, pool_row, nslot, nn, lane, false);

    // Online softmax over this tile's 32 tokens; lane holds tokens nt * 8 + 2 * tig + {0, 1}.
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool valid = nt * 8 + 2 * tig + j < n;
        s[nt][j] = valid ? s[nt][j] * scale_log2 : -INFINITY;
        s[nt][j + 2] = valid ? s[nt][j + 2] * scale_log2 : -INFINITY;
        mx0 = fmaxf(mx0, s[nt][j]);
        mx1 = fmaxf(mx1, s[nt][j + 2]);
      }
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);  // finite: token 0 of a tile is valid
    const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
    m0 = mn0;
    m1 = mn1;
    l0 *= c0;
    l1 *= c1;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        s[nt][j] = exp2f(s[nt][j] - mn0);
        s[nt][j + 2] = exp2f(s[nt][j + 2] - mn1);
        l0 += s[nt][j];
        l1 += s[nt][j + 2];
      }
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= c0;
      o[dt][1] *= c0;
      o[dt][2] *= c1;
      o[dt][3] *= c1;
    }

    cp_async_wait<1>();
    __syncwarp();
    if constexpr (F8) {
      convert_tile<HD>(s_v, GT::kStride, st_v, n, lane, true);
      __syncwarp();
      load_tile<GT::kChunks8>(st_v, GT::kRow8, vbase, pool_row, nslot, nn, lane, false);
    }
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const unsigned pa[4] = {pack2<M>(s[2 * ks][0], s[2 * ks][1]), pack2<M>(s[2 * ks][2], s[2 * ks][3]),
                              pack2<M>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                              pack2<M>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int d2 = 0; d2 < DT / 2; ++d2) {
        unsigned r0, r1, r2, r3;
        ldsm_x4_t(v_addr + ks * 16 * GT::kStride + d2 * 32, r0, r1, r2, r3);
        mma<M>(o[2 * d2], pa, r0, r1);
        mma<M>(o[2 * d2 + 1], pa, r2, r3);
      }
    }
    __syncwarp();
    if constexpr (!F8) load_tile<GT::kChunks>(s_v, GT::kStride, vbase, pool_row, nslot, nn, lane, true);
    n = nn;
    slot = nslot;
  }
  cp_async_wait<0>();
#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) l0 += __shfl_xor_sync(0xffffffffu, l0, off);
  if constexpr (F8) {  // V's scale: the partial is linear in V
    const float sv = kv_scales[kv_heads + h];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= sv;
      o[dt][1] *= sv;
      o[dt][2] *= sv;
      o[dt][3] *= sv;
    }
  }
}

// One block per (sequence, KV head, split); its four warps take turns over the split's
// 32-token tiles and merge their partials through shared memory at the end.
// Three blocks an SM (their tiles take 3 x 68 KiB of shared memory): uncapped, 172 registers let only
// two fit. Capped at 168 (20 bytes spilled) the occupancy is 12 warps instead of 8, but the time at
// 64 x 2048 stayed 151 us (ncu: DRAM 77 %, L2 89 %): the kernel is bound by the L2, not by latency.
template <typename T, int HD, int G, bool F8>
__global__ void __launch_bounds__(kWarps * 32, F8 ? 2 : 3)
    decode_partial_mma(const T* __restrict__ q, const void* __restrict__ kv, int64_t pool_rows,
                       const int64_t* __restrict__ slots, int64_t s_max, const int64_t* __restrict__ lengths,
                       int kv_heads, int64_t chunk, int splits, float scale_log2, const float* __restrict__ kv_scales,
                       float* __restrict__ part_acc, float* __restrict__ part_ml) {
  using GT = MGeo<HD, F8>;
  constexpr int DT = HD / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x / kv_heads;
  const int h = blockIdx.x - b * kv_heads;
  const int split = blockIdx.y;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int gid = lane >> 2;
  const int tig = lane & 3;
  const int nh = kv_heads * G;
  float o[DT][4];
  float m0, l0;
  warp_attend<T, HD, G, F8>(q, kv, pool_rows, slots, s_max, lengths, kv_heads, chunk, b, h, split, warp * kTile,
                            kWarps * kTile, smem + warp * GT::kWarpBytes, scale_log2, kv_scales, lane, o, m0, l0);
  __syncthreads();  // the tiles' memory holds the warps' partials now

  __shared__ float s_m[kWarps][G];
  __shared__ float s_l[kWarps][G];
  float(*s_acc)[G][HD] = reinterpret_cast<float(*)[G][HD]>(smem);
  if (gid < G) {
    if (tig == 0) {
      s_m[warp][gid] = m0;
      s_l[warp][gid] = l0;
    }
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      s_acc[warp][gid][dt * 8 + 2 * tig] = o[dt][0];
      s_acc[warp][gid][dt * 8 + 2 * tig + 1] = o[dt][1];
    }
  }
  __syncthreads();
  attn::store_split_partial<kWarps, G, HD>(s_m, s_l, s_acc, b, nh, h, splits, split, part_acc, part_ml);
}

template <typename Kernel>
void raise_smem(Kernel kernel, int bytes, bool (&raised)[64], int device) {
  if (device < 0 || device >= 64 || !raised[device]) {
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
          "cudaFuncSetAttribute (decode attention shared memory)");
    if (device >= 0 && device < 64) raised[device] = true;
  }
}

template <typename T, int HD, int G, bool F8>
void launch(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
            const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
            const float* kv_scales, float* part_acc, float* part_ml, void* out, int device,
            cudaStream_t stream) {
  using GT = MGeo<HD, F8>;
  static_assert(kWarps * G * HD * 4 <= GT::kSmem, "partials do not fit the tiles");
  const float scale_log2 = scale * 1.4426950408889634f;
  const int kvh = static_cast<int>(kv_heads);
  static bool raised[64] = {};
  raise_smem(decode_partial_mma<T, HD, G, F8>, GT::kSmem, raised, device);
  const dim3 grid(static_cast<unsigned>(batch * kv_heads), static_cast<unsigned>(splits));
  decode_partial_mma<T, HD, G, F8><<<grid, kWarps * 32, GT::kSmem, stream>>>(
      static_cast<const T*>(q), kv, pool_rows, slots, s_max, lengths, kvh, chunk, splits, scale_log2, kv_scales,
      part_acc, part_ml);
  check(cudaGetLastError(), "decode_partial_mma launch");
  attn::decode_merge<T><<<static_cast<unsigned>(batch * kv_heads * G), HD, 0, stream>>>(part_acc, part_ml, splits, HD,
                                                                                     static_cast<T*>(out));
  check(cudaGetLastError(), "decode_merge launch");
}

template <typename T, int HD, bool F8>
void by_group(int64_t group, const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
              const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
              const float* kv_scales, float* part_acc, float* part_ml, void* out, int device,
              cudaStream_t stream) {
#define TANDEM_MMA_GROUP(N)                                                                                     \
  case N:                                                                                                     \
    launch<T, HD, N, F8>(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, \
                         kv_scales, part_acc, part_ml, out, device, stream);                        \
    return;
  switch (group) {
    TANDEM_MMA_GROUP(1)
    TANDEM_MMA_GROUP(2)
    TANDEM_MMA_GROUP(3)
    TANDEM_MMA_GROUP(4)
    TANDEM_MMA_GROUP(5)
    TANDEM_MMA_GROUP(6)
    TANDEM_MMA_GROUP(7)
    TANDEM_MMA_GROUP(8)
    default:
      throw std::runtime_error("decode_attention_mma: group " + std::to_string(group) + " not in 1..8");
  }
#undef TANDEM_MMA_GROUP
}

template <typename T, bool F8>
void by_head_dim(int64_t head_dim, int64_t group, const void* q, const void* kv, int64_t pool_rows,
                 const int64_t* slots, int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads,
                 float scale, int64_t chunk, int splits, const float* kv_scales, float* part_acc, float* part_ml,
                 void* out, int device, cudaStream_t stream) {
  if (head_dim == 64) {
    by_group<T, 64, F8>(group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk,
                        splits, kv_scales, part_acc, part_ml, out, device, stream);
  } else {
    by_group<T, 128, F8>(group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk,
                         splits, kv_scales, part_acc, part_ml, out, device, stream);
  }
}

template <typename T>
void by_kv_type(int64_t head_dim, int64_t group, const void* q, const void* kv, int64_t pool_rows,
                const int64_t* slots, int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads,
                float scale, int64_t chunk, int splits, const float* kv_scales, float* part_acc, float* part_ml,
                void* out, int device, cudaStream_t stream) {
  if (kv_scales != nullptr) {
    by_head_dim<T, true>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                         chunk, splits, kv_scales, part_acc, part_ml, out, device, stream);
  } else {
    by_head_dim<T, false>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                          chunk, splits, nullptr, part_acc, part_ml, out, device, stream);
  }
}

}  // namespace

bool mma_fp8_supported(int dtype, int64_t head_dim, int64_t group) {
  return (dtype == 1 || dtype == 2) && (head_dim == 64 || head_dim == 128) && group >= 1 && group <= 8;
}

void decode_attention_mma(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
                          const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim,
                          int dtype, float scale, int64_t chunk, int splits, float* part_acc, float* part_ml,
                          void* out, int device, cudaStream_t stream, const float* kv_scales) {
  if (!mma_fp8_supported(dtype, head_dim, group)) {  // the same shapes the 16-bit mma path takes
    if (kv_scales != nullptr) {
      throw std::runtime_error("decode_attention: E4M3 KV needs a float16/bfloat16 q, head_dim 64/128, group 1..8");
    }
    decode_attention_staged(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, group, head_dim, dtype, scale,
                            chunk, splits, part_acc, part_ml, out, device, stream);
    return;
  }
  if (dtype == 1) {
    by_kv_type<__half>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk,
                       splits, kv_scales, part_acc, part_ml, out, device, stream);
  } else {
    by_kv_type<__nv_bfloat16>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                              chunk, splits, kv_scales, part_acc, part_ml, out, device, stream);
  }
}

}  // namespace tandem
