// Paged decode attention: one query row per sequence attending over its own KV slots in the pool,
// read in place (see decode_attention.cu for why and how).
//
// Geometry: `q` is [B, KVH * G, HD] (G query heads share each KV head, grouped-query attention), the
// layer's pool slice `kv` is [2, pool_rows, KVH, HD] (K then V), `slots` [B, S] int64 holds each
// sequence's slot per position (only the first lengths[b] entries are read), `lengths` [B] int64
// (1 <= lengths[b] <= S). Output `out` [B, KVH * G, HD] in q's dtype. `dtype`: 0 float32, 1 float16,
// 2 bfloat16. Work buffers `part_acc` float32 [B, KVH * G, splits, HD] and `part_ml` float32
// [B, KVH * G, splits, 2] with splits = ceil(S / chunk). All pointers are device pointers of
// `device`; nothing is synchronised (the two kernels run on `stream`, so a CUDA graph can capture
// them). The kernel: tensor cores on K/V tiles staged by cp.async for float16/bfloat16 with head_dim
// 64/128 (decode_attention_mma.cu), the same staging with FMA arithmetic otherwise
// (decode_attention_staged.cu); groups 1..8. Nothing is checked here beyond `supported`: the Python
// wrapper checks shapes, dtypes and devices. Errors are thrown as std::runtime_error.
// `kv_scales`: nullptr when `kv` holds q's dtype; else `kv` holds float8_e4m3fn
// (its rows HD bytes) and kv_scales is float32 [2, KVH], the layer's K then V scale of each KV head
// (K = stored * scale): tandem.kv.dtype=fp8.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tandem {

// Whether decode_attention has a kernel for this dtype, head dim and group size (with `kv_fp8`, for an
// E4M3 KV).
bool decode_attention_supported(int dtype, int64_t head_dim, int64_t group, bool kv_fp8 = false);

void decode_attention(const void* q, const void* kv, int64_t pool_rows, const int64_t* slots, int64_t s_max,
                      const int64_t* lengths, int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim,
                      int dtype, float scale, int64_t chunk, float* part_acc, float* part_ml, void* out,
                      int device, cudaStream_t stream, const float* kv_scales = nullptr);

}  // namespace tandem
