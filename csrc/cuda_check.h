// What the kernel files (kv_kernels.cu, kv_checksum.cu, decode_attention.cu, gemv.cu, each compiled on
// its own) share: turning a CUDA error into an exception Python sees, the device's multiprocessor count
// their grids are sized by, and running a launch with a device current.
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

// Runs `body` with `device` current, restoring the caller's device (also when it throws).
template <typename F>
void on_device(int device, F&& body) {
  int previous = 0;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  if (previous != device) check(cudaSetDevice(device), "cudaSetDevice");
  try {
    body();
  } catch (...) {
    if (previous != device) cudaSetDevice(previous);
    throw;
  }
  if (previous != device) check(cudaSetDevice(previous), "cudaSetDevice (restore)");
}

}  // namespace tandem
