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
// Layout of the work: a block per (sequence b, KV head h, split) (its G query heads ride along, so K/V
// are read once per group) over tokens [split * chunk, ...); each warp keeps an online softmax and the
// block writes one partial per (query head, split); a second kernel merges the splits. Float32
// accumulation throughout; the output is q's dtype.
//
// Two kernels, this file only dispatches: the default, tensor cores (mma.sync) on K/V tiles staged by
// cp.async, for float16/bfloat16 with head_dim 64/128 and any E4M3 KV (decode_attention_mma.cu); its
// fallback for every other shape (float32, head_dim 256), the same staging with FMA arithmetic
// (decode_attention_staged.cu). Three more kernels were measured and deleted (one token per warp, one
// token per lane with K rows read per lane, and a block over a split's KV heads): none was faster where
// the default runs (docs/benchmarks/README.md keeps their numbers).
#include "decode_attention.h"
#include "cuda_check.h"
#include "decode_attention_common.cuh"

#include <stdexcept>
#include <string>

namespace tandem {

bool decode_attention_supported(int dtype, int64_t head_dim, int64_t group, bool kv_fp8) {
  if (kv_fp8) return mma_fp8_supported(dtype, head_dim, group);
  return staged_supported(dtype, head_dim, group);
}

void decode_attention(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
                      const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim,
                      int dtype, float scale, int64_t chunk, float* part_acc, float* part_ml, void* out,
                      int device, cudaStream_t stream, const float* kv_scales) {
  if (!decode_attention_supported(dtype, head_dim, group, kv_scales != nullptr)) {
    throw std::runtime_error("decode_attention: no kernel for dtype " + std::to_string(dtype) + ", head_dim " +
                             std::to_string(head_dim) + ", group " + std::to_string(group) +
                             (kv_scales != nullptr ? ", E4M3 KV" : ""));
  }
  if (batch <= 0 || kv_heads <= 0 || s_max <= 0 || chunk <= 0) {
    throw std::runtime_error("decode_attention: batch, kv_heads, s_max and chunk must be positive");
  }
  const int64_t splits = (s_max + chunk - 1) / chunk;
  if (splits > 65535 || batch * kv_heads > 0x7fffffff) {
    throw std::runtime_error("decode_attention: grid too large (lower s_max or raise chunk)");
  }
  on_device(device, [&] {
    // The tensor-core kernel where it has the shape, else the staged FMA kernel (its own check).
    decode_attention_mma(q, kv, pool_rows, slots, s_max, lengths, batch, kv_heads, group, head_dim, dtype, scale,
                         chunk, static_cast<int>(splits), part_acc, part_ml, out, device, stream, kv_scales);
  });
}

}  // namespace tandem
