// KV row copies between a layer-major paged pool and a contiguous staging buffer (see kv_kernels.cu),
// and the KV checksum read in place from such rows (see kv_checksum.cu).
//
// Geometry shared by every entry point: `num_lt` = num_layers * 2 (K and V) outer rows; each holds a
// token axis of rows of `row_bytes` (= num_kv_heads * head_dim * element size). A pool has `pool_rows`
// slots on that axis (`kv[L, 2, S, H*D]`); staging has exactly `n_tokens` (`[L, 2, T, H*D]`).
// Slots are int64 device arrays of length `n_tokens`. Pointers are device pointers (a peer-mapped
// pointer is fine for the destination); nothing is checked here: the Python wrapper checks dtype,
// device, contiguity and bounds before calling (checksum_rows alone checks slot bounds itself, in the
// kernel, so that it needs no host sync). Errors are thrown as std::runtime_error.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace tandem {

// dst[lt, d_row(t), :] = src[lt, s_row(t), :] for every lt < num_lt, t < n_tokens, where
// s_row(t) = src_slots ? src_slots[t] : t (likewise d_row). Runs on `stream` of `device`.
void copy_rows(const void* src, const int64_t* src_slots, int64_t src_rows, void* dst, const int64_t* dst_slots,
               int64_t dst_rows, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, int device,
               cudaStream_t stream);

// copy_rows, and the two lanes of kv_checksum over the rows it moves (as checksum_rows below: the
// staging buffer's words in wire order) into out[0..1]; out[2] = 0. `out` (3 device words) is zeroed
// and then accumulated on `stream`; nothing synchronises. Since the kernel hashes the vectors it
// stores, the lanes describe what it wrote. Needs 8-byte aligned pointers and row_bytes % 8 == 0
// (throws std::invalid_argument otherwise).
void copy_rows_checksum(const void* src, const int64_t* src_slots, int64_t src_rows, void* dst,
                        const int64_t* dst_slots, int64_t dst_rows, int64_t num_lt, int64_t n_tokens,
                        int64_t row_bytes, uint64_t* out, int device, cudaStream_t stream);

// The vector width (bytes) copy_rows will use for these pointers and row size: 16, 8, 4, 2 or 1.
int vector_bytes(const void* src, const void* dst, int64_t row_bytes);

// The two lanes of transfer/checksum.py's kv_checksum over the rows of `src` in wire order, read in
// place (kv_checksum.cu): the words are those of the staging buffer a gather by `slots` would fill,
// w_i for i = (lt * n_tokens + t) * (row_bytes / 8) + k, and
//   out[0] = sum w_i,   out[1] = sum h(i) * w_i   (mod 2^64),
//   out[2] = the number of rows skipped because slots[t] is outside [0, src_rows) (the caller raises).
// Row (lt, t) is read at src + (lt * src_rows + slot(t)) * row_bytes, slot(t) = slots ? slots[t] : t.
// `out` (3 device words) is zeroed and then accumulated on `stream`; nothing synchronises. Needs
// row_bytes % 8 == 0 and an 8-byte aligned `src` (the wrapper falls back to torch otherwise).
void checksum_rows(const void* src, const int64_t* slots, int64_t src_rows, int64_t num_lt, int64_t n_tokens,
                   int64_t row_bytes, uint64_t* out, int device, cudaStream_t stream);

}  // namespace tandem
