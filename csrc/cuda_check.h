// What the kernel files (kv_kernels.cu, kv_checksum.cu, decode_attention.cu, each compiled on its own)
// share: turning a CUDA error into an exception Python sees, and the device's multiprocessor count
// their grids are sized by.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace tandem {

// Throws std::runtime_error("<what>: <error name> (<error string>)") unless `err` is cudaSuccess.
inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) +
                             ")");
  }
}

// Multiprocessors of `device`, asked once per device (the first 64 devices are cached).
inline int sm_count(int device) {
  static int cached[64] = {0};
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

}  // namespace tandem
