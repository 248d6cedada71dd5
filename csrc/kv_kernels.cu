// Gather / scatter / fused gather-write of KV rows (one kernel, three uses).
//
// Why one kernel: all three move whole rows (one layer's K or V of one token, 2 KiB for the
// qwen3-4b shape) between two row spaces that differ only in how a token index maps to a row:
// identity for contiguous staging, `slots[t]` for a paged pool. A fragmented pool (page size 1,
// shuffled) makes every row its own chunk, so per-chunk copies are out of the question
// (docs/transfer.md, "Two modes": one request became 105,660 chunks, copied one by one in 48.5 ms); here each warp moves one row per step with 16-byte vector loads and
// stores, all of a row's loads in flight before its stores, and the grid strides over rows, so the
// cost is bandwidth-bound whatever the fragmentation.
#include "kv_kernels.h"
#include "cuda_check.h"
#include "kv_checksum.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace tandem {
namespace {

constexpr int kThreads = 256;  // 8 warps per block
constexpr int kUnroll = 4;     // vectors per lane in flight: a 2 KiB row is one step of 32 x 4 x 16 B

// kSum: also hash what is moved (the rows as read, which is what lands) into out[0..1], exactly as
// kv_checksum of the wire-order staging buffer would: row r = lt * n_tokens + t, vector v holds words
// r * row_words + v * kWords<V>. V is then ulonglong2 or unsigned long long (whole 8-byte words).
template <typename V, bool kSum>
__global__ void __launch_bounds__(kThreads)
    copy_rows_kernel(const char* __restrict__ src, const int64_t* __restrict__ src_slots, int64_t src_rows,
                     char* __restrict__ dst, const int64_t* __restrict__ dst_slots, int64_t dst_rows,
                     int64_t num_lt, int64_t n_tokens, int64_t row_vecs, csum::u64* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t total = num_lt * n_tokens;
  csum::Lanes acc;
  for (int64_t r = warp; r < total; r += n_warps) {
    const int64_t lt = r / n_tokens;
    const int64_t t = r - lt * n_tokens;
    const int64_t s_row = src_slots != nullptr ? __ldg(src_slots + t) : t;
    const int64_t d_row = dst_slots != nullptr ? __ldg(dst_slots + t) : t;
    const V* s = reinterpret_cast<const V*>(src) + (lt * src_rows + s_row) * row_vecs;
    V* d = reinterpret_cast<V*>(dst) + (lt * dst_rows + d_row) * row_vecs;
    for (int64_t v0 = lane; v0 < row_vecs; v0 += 32 * kUnroll) {
      V buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v < row_vecs) buf[u] = s[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v < row_vecs) d[v] = buf[u];
      }
      if constexpr (kSum) {  // after the stores are issued: the hash overlaps their flight
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + 32 * u;
          if (v < row_vecs) acc.add(static_cast<csum::u64>(r * row_vecs + v) * csum::kWords<V>, buf[u]);
        }
      }
    }
  }
  if constexpr (kSum) csum::reduce_into<kThreads>(acc.a, acc.finish(), out);
}

template <typename V, bool kSum = false>
void launch(const void* src, const int64_t* src_slots, int64_t src_rows, void* dst, const int64_t* dst_slots,
            int64_t dst_rows, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, int device,
            cudaStream_t stream, csum::u64* out = nullptr) {
  const int64_t total = num_lt * n_tokens;
  const int64_t warps_per_block = kThreads / 32;
  const int64_t wanted = (total + warps_per_block - 1) / warps_per_block;
  const int64_t cap = static_cast<int64_t>(sm_count(device)) * 8;  // grid-stride beyond ~8 blocks per SM
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min(wanted, cap)));
  copy_rows_kernel<V, kSum><<<blocks, kThreads, 0, stream>>>(
      static_cast<const char*>(src), src_slots, src_rows, static_cast<char*>(dst), dst_slots, dst_rows, num_lt,
      n_tokens, row_bytes / static_cast<int64_t>(sizeof(V)), out);
  check(cudaGetLastError(), "copy_rows launch");
}

}  // namespace

int vector_bytes(const void* src, const void* dst, int64_t row_bytes) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                        static_cast<uint64_t>(row_bytes);
  for (int w : {16, 8, 4, 2}) {
    if ((bits & static_cast<uint64_t>(w - 1)) == 0) return w;
  }
  return 1;
}

void copy_rows(const void* src, const int64_t* src_slots, int64_t src_rows, void* dst, const int64_t* dst_slots,
               int64_t dst_rows, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, int device,
               cudaStream_t stream) {
  if (num_lt <= 0 || n_tokens <= 0 || row_bytes <= 0) return;  // nothing to move
  on_device(device, [&] {
    switch (vector_bytes(src, dst, row_bytes)) {
      case 16:
        launch<uint4>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device, stream);
        break;
      case 8:
        launch<uint2>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device, stream);
        break;
      case 4:
        launch<uint32_t>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device,
                         stream);
        break;
      case 2:
        launch<uint16_t>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device,
                         stream);
        break;
      default:
        launch<uint8_t>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device,
                        stream);
    }
  });
}

void copy_rows_checksum(const void* src, const int64_t* src_slots, int64_t src_rows, void* dst,
                        const int64_t* dst_slots, int64_t dst_rows, int64_t num_lt, int64_t n_tokens,
                        int64_t row_bytes, uint64_t* out, int device, cudaStream_t stream) {
  const int width = vector_bytes(src, dst, row_bytes);
  if (width < 8) {
    throw std::invalid_argument("copy_rows_checksum needs 8-byte aligned pointers and rows of a multiple of "
                                "8 bytes, got rows of " + std::to_string(row_bytes) + " bytes");
  }
  on_device(device, [&] {
    auto* lanes = reinterpret_cast<csum::u64*>(out);
    check(cudaMemsetAsync(lanes, 0, 3 * sizeof(csum::u64), stream), "cudaMemsetAsync");
    if (num_lt <= 0 || n_tokens <= 0 || row_bytes <= 0) return;  // no words: both lanes 0
    if (width == 16) {
      launch<ulonglong2, true>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens, row_bytes,
                               device, stream, lanes);
    } else {
      launch<unsigned long long, true>(src, src_slots, src_rows, dst, dst_slots, dst_rows, num_lt, n_tokens,
                                       row_bytes, device, stream, lanes);
    }
  });
}

}  // namespace tandem
