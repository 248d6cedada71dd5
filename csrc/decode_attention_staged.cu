// Paged decode attention, the fallback kernel (every shape the tensor-core kernel of
// decode_attention_mma.cu does not take: float32, head_dim 256): one token per lane for the scores, with
// its K and V rows staged in shared memory by cp.async.
//
// Why: a kernel with the same mapping that read K rows per lane (deleted since) read KV at 42 % of HBM
// at 64 x 2048 on an H200 (docs/benchmarks). There each lane loads its own token's whole K row (16 x 16 bytes), so one warp load touches 32 rows: 32 cache lines
// for 512 useful bytes, which keeps the L1 busy for a fraction of the bytes the SM needs, and a warp has
// only a few kilobytes in flight before it stops to compute. Here a warp copies a 32-token tile of K
// and of V with cp.async, each 16-byte piece by a different lane, so a warp copy covers whole rows
// (coalesced), and the copies of the next tile are in flight while the current one is computed:
//
//   tile i:  wait K(i) | scores from shared K | issue K(i+1) | softmax | wait V(i) | P.V | issue V(i+1)
//
// The scores: lane j owns token j, q in shared memory as float32 times scale * log2 e; K rows are padded by 16 bytes in shared memory so the lanes' 16-byte reads of 32
// different rows hit distinct banks. P.V: lanes own head dimensions; each token's weight comes by
// shuffle from its lane. Each warp keeps an online softmax; the block merges its warps and writes one
// partial per (query head, split); attn::decode_merge merges the splits. Any group size 1..8 (Orpheus'
// 3, Qwen2.5-0.5B's 7). A warp's tiles: 32 x (2 x row + 16) bytes; 4 warps a block for rows up to 256
// bytes (bf16 x 128: 68 KiB, three blocks an SM), 2 for 512, 1 for 1024 (float32 x 256).
#include "cuda_check.h"
#include "decode_attention_common.cuh"

#include <stdexcept>
#include <string>

namespace tandem {
namespace {

using attn::cp_async16;
using attn::cp_async_commit;
using attn::cp_async_wait;
using attn::load_tile;
using attn::from_float;
using attn::Pack;
using attn::to_float;

constexpr int kTile = 32;  // tokens per warp tile: one per lane for the scores

template <typename T, int HD>
struct Geo {
  static constexpr int kRowBytes = HD * static_cast<int>(sizeof(T));
  static constexpr int kChunks = kRowBytes / 16;  // 16-byte pieces of a row
  static constexpr int kKStride = kRowBytes + 16;  // padded K row in shared memory
  static constexpr int kWarps = kRowBytes <= 256 ? 4 : (kRowBytes <= 512 ? 2 : 1);
  static constexpr int kWarpBytes = kTile * (kKStride + kRowBytes);
  static constexpr int kQBytes = 8 * HD * 4;  // room for G <= 8 query heads in float32
  static constexpr int kSmem = kQBytes + kWarps * kWarpBytes;
};

template <typename T, int EPL, int G>
__global__ void __launch_bounds__(Geo<T, 32 * EPL>::kWarps * 32)
    decode_partial_staged(const T* __restrict__ q, const T* __restrict__ kv, int64_t pool_rows,
                          const int64_t* __restrict__ slots, int64_t s_max, const int64_t* __restrict__ lengths,
                          int kv_heads, int64_t chunk, int splits, float scale_log2, float* __restrict__ part_acc,
                          float* __restrict__ part_ml) {
  constexpr int HD = 32 * EPL;
  using GT = Geo<T, HD>;
  constexpr int NW = GT::kWarps;
  constexpr int VEC = 16 / static_cast<int>(sizeof(T));
  constexpr int NV = HD / VEC;
  using P = Pack<T, EPL>;
  extern __shared__ __align__(16) unsigned char smem[];
  float(*s_q)[HD] = reinterpret_cast<float(*)[HD]>(smem);
  unsigned char* tiles = smem + GT::kQBytes;

  const auto [b, h, split, warp, lane, nh, len, t0, t1] = attn::split_block<G>(kv_heads, lengths, chunk);
  unsigned char* s_k = tiles + warp * GT::kWarpBytes;
  unsigned char* s_v = s_k + kTile * GT::kKStride;

  const int64_t pool_row = static_cast<int64_t>(kv_heads) * GT::kRowBytes;  // bytes per slot of K (or V)
  const unsigned char* kbase = reinterpret_cast<const unsigned char*>(kv) + static_cast<int64_t>(h) * GT::kRowBytes;
  const unsigned char* vbase = kbase + pool_rows * pool_row;
  const int64_t* srow = slots + static_cast<int64_t>(b) * s_max;

  // Start this warp's first tile before anything else.
  int64_t base = t0 + warp * kTile;
  int n = t1 - base >= kTile ? kTile : (t1 > base ? static_cast<int>(t1 - base) : 0);
  int64_t slot = lane < n ? srow[base + lane] : 0;
  load_tile<GT::kChunks>(s_k, GT::kKStride, kbase, pool_row, slot, n, lane, false);
  load_tile<GT::kChunks>(s_v, GT::kRowBytes, vbase, pool_row, slot, n, lane, false);

  for (int i = threadIdx.x; i < G * HD; i += NW * 32) {
    const int g = i / HD;
    s_q[g][i - g * HD] = to_float(q[(static_cast<int64_t>(b) * nh + h * G) * HD + i]) * scale_log2;
  }
  __syncthreads();

  float m[G], l[G], acc[G][EPL];
  attn::init_state(m, l, acc);

  for (; base < t1; base += NW * kTile) {
    const int64_t next = base + NW * kTile;
    const int nn = t1 - next >= kTile ? kTile : (t1 > next ? static_cast<int>(t1 - next) : 0);
    const int64_t nslot = lane < nn ? srow[next + lane] : 0;

    cp_async_wait<1>();  // this tile's K (its V may still be in flight)
    __syncwarp();
    float s[G];
#pragma unroll
    for (int g = 0; g < G; ++g) s[g] = 0.f;
    if (lane < n) {
      const uint4* krow = reinterpret_cast<const uint4*>(s_k + lane * GT::kKStride);
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
    __syncwarp();  // every lane has read its K row: the buffer takes the next tile
    load_tile<GT::kChunks>(s_k, GT::kKStride, kbase, pool_row, nslot, nn, lane, false);

    float p[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float sg = lane < n ? s[g] : -INFINITY;
      float tmax = sg;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
      const float mn = fmaxf(m[g], tmax);  // finite: lane 0's token is always valid
      const float corr = exp2f(m[g] - mn);
      p[g] = lane < n ? exp2f(sg - mn) : 0.f;
      float psum = p[g];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      l[g] = l[g] * corr + psum;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] *= corr;
      m[g] = mn;
    }

    cp_async_wait<1>();  // this tile's V (the next K may still be in flight)
    __syncwarp();
    const unsigned char* vrow = s_v + lane * EPL * static_cast<int>(sizeof(T));
    for (int j = 0; j < n; ++j) {
      const P vp = *reinterpret_cast<const P*>(vrow + j * GT::kRowBytes);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float pj = __shfl_sync(0xffffffffu, p[g], j);
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] += pj * to_float(vp.v[e]);
      }
    }
    __syncwarp();  // every lane has read the V tile
    load_tile<GT::kChunks>(s_v, GT::kRowBytes, vbase, pool_row, nslot, nn, lane, false);
    n = nn;
    slot = nslot;
  }
  cp_async_wait<0>();
  __syncthreads();  // all warps done with their tiles: the tile memory holds the warps' partials now

  __shared__ float s_m[NW][G];
  __shared__ float s_l[NW][G];
  float(*s_acc)[G][HD] = reinterpret_cast<float(*)[G][HD]>(tiles);
  attn::stash_warp_state<EPL, G, HD>(s_m, s_l, s_acc, warp, lane, m, l, acc);
  __syncthreads();
  attn::store_split_partial<NW, G, HD>(s_m, s_l, s_acc, b, nh, h, splits, split, part_acc, part_ml);
}

template <typename T, int EPL, int G>
void launch(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
            const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
            float* part_acc, float* part_ml, void* out, int device, cudaStream_t stream) {
  using GT = Geo<T, 32 * EPL>;
  static_assert(G * 32 * EPL * 4 <= GT::kQBytes, "q does not fit its shared memory");
  static_assert(GT::kWarps * G * 32 * EPL * 4 <= GT::kWarps * GT::kWarpBytes, "partials do not fit the tiles");
  // More than 48 KiB of dynamic shared memory needs the attribute, per function and device; set once,
  // on the first (eager) call, never inside a graph capture.
  static bool raised[64] = {};
  if (device < 0 || device >= 64 || !raised[device]) {
    check(cudaFuncSetAttribute(decode_partial_staged<T, EPL, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               GT::kSmem),
          "cudaFuncSetAttribute (decode attention shared memory)");
    if (device >= 0 && device < 64) raised[device] = true;
  }
  const float scale_log2 = scale * 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>(batch * kv_heads), static_cast<unsigned>(splits));
  decode_partial_staged<T, EPL, G><<<grid, GT::kWarps * 32, GT::kSmem, stream>>>(
      static_cast<const T*>(q), static_cast<const T*>(kv), pool_rows, slots, s_max, lengths,
      static_cast<int>(kv_heads), chunk, splits, scale_log2, part_acc, part_ml);
  check(cudaGetLastError(), "decode_partial_staged launch");
  attn::decode_merge<T><<<static_cast<unsigned>(batch * kv_heads * G), 32 * EPL, 0, stream>>>(
      part_acc, part_ml, splits, 32 * EPL, static_cast<T*>(out));
  check(cudaGetLastError(), "decode_merge launch");
}

template <typename T, int EPL>
void by_group(int64_t group, const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
              const int64_t* lengths, int64_t batch, int64_t kv_heads, float scale, int64_t chunk, int splits,
              float* part_acc, float* part_ml, void* out, int device, cudaStream_t stream) {
#define TANDEM_STAGED_GROUP(N)                                                                                  \
  case N:                                                                                                     \
    launch<T, EPL, N>(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits, part_acc, \
                      part_ml, out, device, stream);                                                          \
    return;
  switch (group) {
    TANDEM_STAGED_GROUP(1)
    TANDEM_STAGED_GROUP(2)
    TANDEM_STAGED_GROUP(3)
    TANDEM_STAGED_GROUP(4)
    TANDEM_STAGED_GROUP(5)
    TANDEM_STAGED_GROUP(6)
    TANDEM_STAGED_GROUP(7)
    TANDEM_STAGED_GROUP(8)
    default:
      throw std::runtime_error("decode_attention_staged: group " + std::to_string(group) + " not in 1..8");
  }
#undef TANDEM_STAGED_GROUP
}

template <typename T>
void by_head_dim(int64_t head_dim, int64_t group, const void* q, const void* kv, int64_t pool_rows,
                 const int64_t* slots, int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads,
                 float scale, int64_t chunk, int splits, float* part_acc, float* part_ml, void* out, int device,
                 cudaStream_t stream) {
  switch (head_dim) {
    case 64:
      return by_group<T, 2>(group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, device, stream);
    case 128:
      return by_group<T, 4>(group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, device, stream);
    case 256:
      return by_group<T, 8>(group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale, chunk, splits,
                            part_acc, part_ml, out, device, stream);
    default:
      throw std::runtime_error("decode_attention_staged: head_dim " + std::to_string(head_dim) + " not 64/128/256");
  }
}

}  // namespace

bool staged_supported(int dtype, int64_t head_dim, int64_t group) {
  return dtype >= 0 && dtype <= 2 && (head_dim == 64 || head_dim == 128 || head_dim == 256) && group >= 1 &&
         group <= 8;
}

void decode_attention_staged(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots,
                             int64_t s_max, const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group,
                             int64_t head_dim, int dtype, float scale, int64_t chunk, int splits, float* part_acc,
                             float* part_ml, void* out, int device, cudaStream_t stream) {
  switch (dtype) {
    case 0:
      return by_head_dim<float>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                                chunk, splits, part_acc, part_ml, out, device, stream);
    case 1:
      return by_head_dim<__half>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, scale,
                                 chunk, splits, part_acc, part_ml, out, device, stream);
    default:
      return by_head_dim<__nv_bfloat16>(head_dim, group, q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads,
                                        scale, chunk, splits, part_acc, part_ml, out, device, stream);
  }
}

}  // namespace tandem
