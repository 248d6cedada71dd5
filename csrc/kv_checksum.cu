// transfer/checksum.py's KV checksum, read in place: the rows of a paged pool, by slot, in wire order.
//
// Why: P is to write D's pool pages directly, with no staging buffer, so both sides hash the request's
// rows where they lie and must still get exactly kv_checksum(staging) of the buffer a gather would
// have filled. The torch version is ~10 small kernels per 64 MiB and re-reads the data through 8 MiB
// temporaries; this is one pass, like copy_rows (kv_kernels.cu): a warp per row (a smaller group of
// lanes for rows under 32 vectors), lanes over the row's 16-byte vectors (8-byte when the row or base
// is not 16-byte aligned), each group a contiguous span of rows. A contiguous source (no slots,
// src_rows == n_tokens) is hashed as one flat array instead, each block a contiguous span, so that
// any row size keeps every lane busy. Per word it is ~30 integer instructions (the position hash),
// which on an H200 is about as long as reading the word: 288 MiB took 77 us flat (a plain torch int64
// sum of it: 75 us) and 94 us as 2 KiB rows at shuffled slots (the gather alone: 874 us).
//
// The definition (transfer/checksum.py), for word i = c * 2^20 + j of the wire-order staging buffer:
//   a = sum w_i,   b = sum T(j) * F(c) * w_i   (mod 2^64)
//   T(j) = splitmix64-mix((j + 1) * 0x9E3779B97F4A7C15) | 1     (the torch code's 2^20-word table)
//   F(c) = fmix64(c + 0x5BD1E995) | 1                            (its per-chunk factor)
// torch does this in wrapping int64, which is the same ring as wrapping uint64 here. Each thread
// keeps sum T(j) * w for the chunk it is in and multiplies by F(c) once per chunk change (a vector's
// words never straddle a chunk: vectors start at word indices that are multiples of their width,
// and 2^20 is). Lanes are summed per warp (shuffles), per block (shared memory), then atomicAdd into
// out[0..1]: addition mod 2^64 commutes, so the result does not depend on the order.
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "kv_checksum.cuh"
#include "kv_kernels.h"

namespace tandem {
namespace {

using u64 = csum::u64;
using csum::kWords;
using csum::Lanes;

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kUnroll = 4;     // vectors per lane in flight, as in copy_rows
constexpr int kMinBlocks = 4;  // rows kernel: at most 64 registers, 32 warps per SM (it wants ~90 unbounded)

__device__ __forceinline__ void reduce_into(u64 a, u64 b, u64* out) { csum::reduce_into<kThreads>(a, b, out); }

__device__ __forceinline__ int64_t slot_of(const int64_t* __restrict__ slots, int64_t t) {
  return slots != nullptr ? __ldg(slots + t) : t;
}

// A group of 2^group_shift lanes per row (a warp for rows of 32 vectors or more, fewer for short rows
// so that no lane idles), rows in wire order r = lt * n_tokens + t, so word i = r * row_words + k.
// Each group hashes a contiguous span of wire rows (total / n_groups, give or take one): (lt, t), the
// row's word index and its layer plane advance by increments (no division per row), consecutive rows
// stay in one 8 MiB chunk (a chunk factor per span, not per row), and the next row's slot is loaded
// before this row's data so that the two reads' latencies overlap.
template <typename V>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    checksum_rows_kernel(const V* __restrict__ src, const int64_t* __restrict__ slots, int64_t src_rows,
                         int64_t num_lt, int64_t n_tokens, int row_vecs, int group_shift,
                         u64* __restrict__ out) {
  const int width = 1 << group_shift;
  const int sub = threadIdx.x & (width - 1);
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> group_shift;
  const int64_t total = num_lt * n_tokens;
  const int64_t plane_vecs = src_rows * row_vecs;
  const u64 row_words = static_cast<u64>(row_vecs) * kWords<V>;
  const int64_t n_groups = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> group_shift;
  int64_t r = group * total / n_groups;  // spans differ by at most one row
  const int64_t r_end = (group + 1) * total / n_groups;
  Lanes acc;
  if (r < r_end) {
    const int64_t lt = r / n_tokens;
    int64_t t = r - lt * n_tokens;
    const V* plane = src + lt * plane_vecs;
    u64 base = static_cast<u64>(r) * row_words;
    int64_t slot = slot_of(slots, t);
    for (; r < r_end; ++r) {
      int64_t next_t = t + 1;
      const V* next_plane = plane;
      if (next_t == n_tokens) {
        next_t = 0;
        next_plane += plane_vecs;
      }
      const int64_t next_slot = r + 1 < r_end ? slot_of(slots, next_t) : 0;
      if (slot < 0 || slot >= src_rows) {  // never read outside the pool; the wrapper raises on out[2]
        if (sub == 0) atomicAdd(out + 2, 1ull);
      } else {
        const V* s = plane + slot * row_vecs;
        for (int v0 = sub; v0 < row_vecs; v0 += width * kUnroll) {
          V buf[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = v0 + width * u;
            if (v < row_vecs) buf[u] = s[v];
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int v = v0 + width * u;
            if (v < row_vecs) acc.add(base + static_cast<u64>(v) * kWords<V>, buf[u]);
          }
        }
      }
      base += row_words;
      t = next_t;
      plane = next_plane;
      slot = next_slot;
    }
  }
  reduce_into(acc.a, acc.finish(), out);
}

// Contiguous words [0, n_vecs * width + tail_words): block k hashes vectors [k * per_block, ...), its
// threads striding by the block, so a thread crosses a chunk boundary about once per 8 MiB.
template <typename V>
__global__ void __launch_bounds__(kThreads)
    checksum_flat_kernel(const V* __restrict__ src, int64_t n_vecs, int64_t per_block, int tail_words,
                         u64* __restrict__ out) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per_block;
  const int64_t end = begin + per_block < n_vecs ? begin + per_block : n_vecs;
  Lanes acc;
  for (int64_t v0 = begin + threadIdx.x; v0 < end; v0 += kThreads * kUnroll) {
    V buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + kThreads * u;
      if (v < end) buf[u] = src[v];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + kThreads * u;
      if (v < end) acc.add(static_cast<u64>(v) * kWords<V>, buf[u]);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // words past the last whole vector (at most width - 1)
    const u64* words = reinterpret_cast<const u64*>(src);
    const u64 first = static_cast<u64>(n_vecs) * kWords<V>;
    for (int k = 0; k < tail_words; ++k) acc.add(first + k, words[first + k]);
  }
  reduce_into(acc.a, acc.finish(), out);
}

// Resident blocks per SM for `kernel` (registers decide it); one grid wave is sm_count x this.
template <typename K>
int blocks_per_sm(K kernel) {
  int n = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return std::max(n, 1);
}

template <typename V>
void launch_rows(const void* src, const int64_t* slots, int64_t src_rows, int64_t num_lt, int64_t n_tokens,
                 int64_t row_bytes, u64* out, int device, cudaStream_t stream) {
  static const int per_sm = blocks_per_sm(checksum_rows_kernel<V>);
  const int row_vecs = static_cast<int>(row_bytes / static_cast<int64_t>(sizeof(V)));
  int group_shift = 0;  // lanes per row: the smallest power of two >= row_vecs, at most a warp
  while (group_shift < 5 && (1 << group_shift) < row_vecs) ++group_shift;
  const int64_t total = num_lt * n_tokens;
  const int64_t rows_per_block = kThreads >> group_shift;
  const int64_t wanted = (total + rows_per_block - 1) / rows_per_block;
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * per_sm;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
  checksum_rows_kernel<V><<<blocks, kThreads, 0, stream>>>(static_cast<const V*>(src), slots, src_rows, num_lt,
                                                           n_tokens, row_vecs, group_shift, out);
  check(cudaGetLastError(), "checksum_rows launch");
}

template <typename V>
void launch_flat(const void* src, int64_t n_words, u64* out, int device, cudaStream_t stream) {
  static const int per_sm = blocks_per_sm(checksum_flat_kernel<V>);
  const int64_t n_vecs = n_words / kWords<V>;
  const int tail_words = static_cast<int>(n_words - n_vecs * kWords<V>);
  const int64_t step = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * per_sm;
  const int64_t wanted = std::max<int64_t>(1, std::min((n_vecs + step - 1) / step, cap));
  const int64_t per_block = std::max<int64_t>(1, ((n_vecs + wanted - 1) / wanted + step - 1) / step) * step;
  const int blocks = static_cast<int>(std::max<int64_t>(1, (n_vecs + per_block - 1) / per_block));
  checksum_flat_kernel<V>
      <<<blocks, kThreads, 0, stream>>>(static_cast<const V*>(src), n_vecs, per_block, tail_words, out);
  check(cudaGetLastError(), "checksum_rows launch");
}

void dispatch(const void* src, const int64_t* slots, int64_t src_rows, int64_t num_lt, int64_t n_tokens,
              int64_t row_bytes, u64* out, int device, cudaStream_t stream) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(src);
  check(cudaMemsetAsync(out, 0, 3 * sizeof(u64), stream), "cudaMemsetAsync");
  if (num_lt <= 0 || n_tokens <= 0 || row_bytes <= 0) return;  // no words: both lanes 0
  if (slots == nullptr && src_rows == n_tokens) {
    const int64_t n_words = num_lt * n_tokens * (row_bytes / 8);
    if (base % 16 == 0) {
      launch_flat<ulonglong2>(src, n_words, out, device, stream);
    } else {
      launch_flat<u64>(src, n_words, out, device, stream);
    }
  } else if (row_bytes / 8 > INT32_MAX) {
    throw std::invalid_argument("checksum_rows: rows of " + std::to_string(row_bytes) + " bytes are too long");
  } else if ((base | static_cast<uintptr_t>(row_bytes)) % 16 == 0) {
    launch_rows<ulonglong2>(src, slots, src_rows, num_lt, n_tokens, row_bytes, out, device, stream);
  } else {
    launch_rows<u64>(src, slots, src_rows, num_lt, n_tokens, row_bytes, out, device, stream);
  }
}

}  // namespace

void checksum_rows(const void* src, const int64_t* slots, int64_t src_rows, int64_t num_lt, int64_t n_tokens,
                   int64_t row_bytes, uint64_t* out, int device, cudaStream_t stream) {
  if (row_bytes < 0 || row_bytes % 8 != 0) {
    throw std::invalid_argument("checksum_rows needs row_bytes to be a multiple of 8, got " +
                                std::to_string(row_bytes));
  }
  if (reinterpret_cast<uintptr_t>(src) % 8 != 0) {
    throw std::invalid_argument("checksum_rows needs an 8-byte aligned source pointer");
  }
  on_device(device, [&] {
    dispatch(src, slots, src_rows, num_lt, n_tokens, row_bytes, reinterpret_cast<u64*>(out), device, stream);
  });
}

}  // namespace tandem
