// transfer/checksum.py's KV checksum, the per-thread part: what kv_checksum.cu's kernels and the
// fused copy in kv_kernels.cu (copy_rows_checksum: P's write into D's pool hashing the rows it moves)
// both compute, so that the two agree by construction. kv_checksum.cu's header comment gives the
// definition; here are its pieces: the position weights T(j) and chunk factors F(c), a thread's two
// lanes (`Lanes`: add words by their index in the wire-order staging buffer), and the block
// reduction into out[0..1] (addition mod 2^64, so the order of threads and blocks does not matter).
#pragma once

#include <cstdint>

namespace tandem {
namespace csum {

using u64 = unsigned long long;  // what atomicAdd and the shuffles take (uint64_t is unsigned long)

constexpr int kChunkBits = 20;
constexpr uint32_t kChunkMask = (1u << kChunkBits) - 1;

__device__ __forceinline__ u64 fmix64(u64 k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  k ^= k >> 33;
  return k;
}

// T(j): j < 2^20, so (j + 1) * golden is a 32 x 64-bit product.
__device__ __forceinline__ u64 table_weight(uint32_t j) {
  u64 x = static_cast<u64>(j + 1u) * 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return (x ^ (x >> 31)) | 1ull;
}

__device__ __forceinline__ u64 chunk_factor(u64 c) { return fmix64(c + 0x5BD1E995ull) | 1ull; }

// One thread's share of the two lanes.
struct Lanes {
  u64 a = 0;      // sum w
  u64 b = 0;      // sum F(c) * T(j) * w over finished chunks
  u64 bc = 0;     // sum T(j) * w within `chunk`
  u64 chunk = 0;  // bc == 0 at the start, so the first flush adds nothing whatever chunk says

  // Called with the index of the first word of a vector before adding its words.
  __device__ __forceinline__ void enter(u64 i) {
    const u64 c = i >> kChunkBits;
    if (c != chunk) {
      b += chunk_factor(chunk) * bc;
      bc = 0;
      chunk = c;
    }
  }
  __device__ __forceinline__ void add_word(u64 i, u64 w) {  // i in `chunk`
    a += w;
    bc += table_weight(static_cast<uint32_t>(i) & kChunkMask) * w;
  }
  __device__ __forceinline__ void add(u64 i, u64 w) {
    enter(i);
    add_word(i, w);
  }
  __device__ __forceinline__ void add(u64 i, const ulonglong2& v) {  // i even: both words in one chunk
    enter(i);
    add_word(i, v.x);
    add_word(i + 1, v.y);
  }
  __device__ __forceinline__ u64 finish() { return b + chunk_factor(chunk) * bc; }
};

template <typename V>
constexpr int kWords = sizeof(V) / 8;

// Sums every thread's lanes into out[0..1] (all `Threads` threads of the block must call it).
template <int Threads>
__device__ __forceinline__ void reduce_into(u64 a, u64 b, u64* out) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_xor_sync(0xFFFFFFFFu, a, offset);
    b += __shfl_xor_sync(0xFFFFFFFFu, b, offset);
  }
  __shared__ u64 part[2][Threads / 32];
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    part[0][warp] = a;
    part[1][warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 sa = 0, sb = 0;
#pragma unroll
    for (int w = 0; w < Threads / 32; ++w) {
      sa += part[0][w];
      sb += part[1][w];
    }
    atomicAdd(out, sa);
    atomicAdd(out + 1, sb);
  }
}

}  // namespace csum
}  // namespace tandem
