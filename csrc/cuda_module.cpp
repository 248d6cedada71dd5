// pybind11 module `tandem.csrc._cuda_kernels`: the KV row kernels (copies and the in-place checksum) and
// paged decode attention, plus the few CUDA runtime / driver calls the GPU transfer paths need (legacy
// IPC handles, VMM export/import/map, async copies).
//
// Everything takes and returns plain ints (device pointers, stream handles, allocation handles) so the
// module imports without libtorch and a probe child can use it without importing torch. Driver-API
// functions (cuMem*) are resolved at run time through cudaGetDriverEntryPointByVersion, so the module
// links only the static CUDA runtime and imports on a machine with no driver (calls then raise).
// Every CUDA error is thrown as RuntimeError naming the call; nothing returns an error code.
// The GIL is released around every call that can block (synchronisation, IPC open, VMM map).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_attention.h"
#include "gemv.h"
#include "kv_kernels.h"

namespace py = pybind11;

namespace {

void check_rt(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a sticky-free error so the next call starts clean
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

// ---- driver entry points ---------------------------------------------------------------------------
struct Driver {
  decltype(&cuGetErrorName) GetErrorName = nullptr;
  decltype(&cuMemCreate) MemCreate = nullptr;
  decltype(&cuMemRelease) MemRelease = nullptr;
  decltype(&cuMemExportToShareableHandle) MemExport = nullptr;
  decltype(&cuMemImportFromShareableHandle) MemImport = nullptr;
  decltype(&cuMemAddressReserve) AddressReserve = nullptr;
  decltype(&cuMemAddressFree) AddressFree = nullptr;
  decltype(&cuMemMap) Map = nullptr;
  decltype(&cuMemUnmap) Unmap = nullptr;
  decltype(&cuMemSetAccess) SetAccess = nullptr;
  decltype(&cuMemGetAllocationGranularity) Granularity = nullptr;
};

template <typename F>
void resolve(const char* name, F* out) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  check_rt(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status),
           "cudaGetDriverEntryPointByVersion");
  if (status != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw std::runtime_error(std::string("driver entry point ") + name + " not found");
  }
  *out = reinterpret_cast<F>(fn);
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    try {
      check_rt(cudaFree(nullptr), "cudaFree(0) (CUDA initialisation)");
      resolve("cuGetErrorName", &d.GetErrorName);
      resolve("cuMemCreate", &d.MemCreate);
      resolve("cuMemRelease", &d.MemRelease);
      resolve("cuMemExportToShareableHandle", &d.MemExport);
      resolve("cuMemImportFromShareableHandle", &d.MemImport);
      resolve("cuMemAddressReserve", &d.AddressReserve);
      resolve("cuMemAddressFree", &d.AddressFree);
      resolve("cuMemMap", &d.Map);
      resolve("cuMemUnmap", &d.Unmap);
      resolve("cuMemSetAccess", &d.SetAccess);
      resolve("cuMemGetAllocationGranularity", &d.Granularity);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) throw std::runtime_error(failure);
  return d;
}

void check_cu(CUresult res, const char* what) {
  if (res != CUDA_SUCCESS) {
    const char* name = "unknown CUresult";
    if (driver().GetErrorName != nullptr) driver().GetErrorName(res, &name);
    throw std::runtime_error(std::string(what) + " failed: " + name + " (" + std::to_string(res) + ")");
  }
}

// Sets `device` current for the scope and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check_rt(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device != previous_) check_rt(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

CUmemAllocationProp vmm_prop(int device, bool fabric) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = fabric ? CU_MEM_HANDLE_TYPE_FABRIC : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

void rows(uintptr_t src, uintptr_t src_slots, int64_t src_rows, uintptr_t dst, uintptr_t dst_slots,
          int64_t dst_rows, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, int device, uintptr_t stream) {
  tandem::copy_rows(reinterpret_cast<const void*>(src), reinterpret_cast<const int64_t*>(src_slots), src_rows,
                    reinterpret_cast<void*>(dst), reinterpret_cast<const int64_t*>(dst_slots), dst_rows, num_lt,
                    n_tokens, row_bytes, device, as_stream(stream));
}

}  // namespace

PYBIND11_MODULE(_cuda_kernels, m) {
  m.doc() = "KV row kernels and CUDA IPC/VMM helpers for tandem (pointers and streams are ints)";

  // ---- kernels (asynchronous on `stream`; arguments named dst* are written) ------------------------
  m.def(
      "gather",
      [](uintptr_t pool, int64_t pool_rows, uintptr_t slots, uintptr_t staging, int64_t num_lt, int64_t n_tokens,
         int64_t row_bytes, int device, uintptr_t stream) {
        rows(pool, slots, pool_rows, staging, 0, n_tokens, num_lt, n_tokens, row_bytes, device, stream);
      },
      py::arg("pool"), py::arg("pool_rows"), py::arg("slots"), py::arg("staging"), py::arg("num_lt"),
      py::arg("n_tokens"), py::arg("row_bytes"), py::arg("device"), py::arg("stream"),
      "staging[lt, t] = pool[lt, slots[t]] (staging written)");
  m.def(
      "scatter",
      [](uintptr_t staging, uintptr_t pool, int64_t pool_rows, uintptr_t slots, int64_t num_lt, int64_t n_tokens,
         int64_t row_bytes, int device, uintptr_t stream) {
        rows(staging, 0, n_tokens, pool, slots, pool_rows, num_lt, n_tokens, row_bytes, device, stream);
      },
      py::arg("staging"), py::arg("pool"), py::arg("pool_rows"), py::arg("slots"), py::arg("num_lt"),
      py::arg("n_tokens"), py::arg("row_bytes"), py::arg("device"), py::arg("stream"),
      "pool[lt, slots[t]] = staging[lt, t] (pool written)");
  m.def(
      "gather_write",
      [](uintptr_t src_pool, int64_t src_rows, uintptr_t src_slots, uintptr_t dst_pool, int64_t dst_rows,
         uintptr_t dst_slots, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, int device, uintptr_t stream) {
        rows(src_pool, src_slots, src_rows, dst_pool, dst_slots, dst_rows, num_lt, n_tokens, row_bytes, device,
             stream);
      },
      py::arg("src_pool"), py::arg("src_rows"), py::arg("src_slots"), py::arg("dst_pool"), py::arg("dst_rows"),
      py::arg("dst_slots"), py::arg("num_lt"), py::arg("n_tokens"), py::arg("row_bytes"), py::arg("device"),
      py::arg("stream"), "dst_pool[lt, dst_slots[t]] = src_pool[lt, src_slots[t]] (dst_pool written)");
  m.def(
      "gather_write_checksum",
      [](uintptr_t src_pool, int64_t src_rows, uintptr_t src_slots, uintptr_t dst_pool, int64_t dst_rows,
         uintptr_t dst_slots, int64_t num_lt, int64_t n_tokens, int64_t row_bytes, uintptr_t out, int device,
         uintptr_t stream) {
        tandem::copy_rows_checksum(reinterpret_cast<const void*>(src_pool), reinterpret_cast<const int64_t*>(src_slots),
                                   src_rows, reinterpret_cast<void*>(dst_pool),
                                   reinterpret_cast<const int64_t*>(dst_slots), dst_rows, num_lt, n_tokens, row_bytes,
                                   reinterpret_cast<uint64_t*>(out), device, as_stream(stream));
      },
      py::arg("src_pool"), py::arg("src_rows"), py::arg("src_slots"), py::arg("dst_pool"), py::arg("dst_rows"),
      py::arg("dst_slots"), py::arg("num_lt"), py::arg("n_tokens"), py::arg("row_bytes"), py::arg("out"),
      py::arg("device"), py::arg("stream"),
      "gather_write, and out[0], out[1] = kv_checksum's lanes over the rows it moved in wire order, out[2] = 0 "
      "(dst_pool and out, 3 words, written)");
  m.def(
      "checksum_rows",
      [](uintptr_t src, int64_t src_rows, uintptr_t slots, int64_t num_lt, int64_t n_tokens, int64_t row_bytes,
         uintptr_t out, int device, uintptr_t stream) {
        tandem::checksum_rows(reinterpret_cast<const void*>(src), reinterpret_cast<const int64_t*>(slots),
                              src_rows, num_lt, n_tokens, row_bytes, reinterpret_cast<uint64_t*>(out), device,
                              as_stream(stream));
      },
      py::arg("src"), py::arg("src_rows"), py::arg("slots"), py::arg("num_lt"), py::arg("n_tokens"),
      py::arg("row_bytes"), py::arg("out"), py::arg("device"), py::arg("stream"),
      "out[0], out[1] = kv_checksum's lanes (a, b) over src's rows at slots in wire order (slots 0: rows "
      "0..n_tokens-1); out[2] = rows skipped for a slot outside [0, src_rows) (out, 3 words, written)");
  m.def("decode_attention_supported", &tandem::decode_attention_supported, py::arg("dtype"), py::arg("head_dim"),
        py::arg("group"), py::arg("kv_fp8") = false,
        "whether decode_attention has a kernel (dtype 0 f32, 1 f16, 2 bf16; kv_fp8: E4M3 KV)");
  m.attr("decode_attention_kv_fp8") = true;  // this build takes kv_scales (tandem.kv.dtype=fp8)
  m.def(
      "decode_attention",
      [](uintptr_t q, uintptr_t kv, int64_t pool_rows, uintptr_t slots, int64_t s_max, uintptr_t lengths,
         int64_t batch, int64_t kv_heads, int64_t group, int64_t head_dim, int dtype, float scale, int64_t chunk,
         uintptr_t part_acc, uintptr_t part_ml, uintptr_t out, int device, uintptr_t stream,
         uintptr_t kv_scales) {
        tandem::decode_attention(reinterpret_cast<const void*>(q), reinterpret_cast<const void*>(kv), pool_rows,
                                 reinterpret_cast<const int64_t*>(slots), s_max,
                                 reinterpret_cast<const int64_t*>(lengths), batch, kv_heads, group, head_dim, dtype,
                                 scale, chunk, reinterpret_cast<float*>(part_acc), reinterpret_cast<float*>(part_ml),
                                 reinterpret_cast<void*>(out), device, as_stream(stream),
                                 reinterpret_cast<const float*>(kv_scales));
      },
      py::arg("q"), py::arg("kv"), py::arg("pool_rows"), py::arg("slots"), py::arg("s_max"), py::arg("lengths"),
      py::arg("batch"), py::arg("kv_heads"), py::arg("group"), py::arg("head_dim"), py::arg("dtype"),
      py::arg("scale"), py::arg("chunk"), py::arg("part_acc"), py::arg("part_ml"), py::arg("out"),
      py::arg("device"), py::arg("stream"), py::arg("kv_scales") = 0,
      "out[b, h] = softmax(q[b, h] . K[slots[b, :len]]) V[...] per sequence, K/V read in place (out written); "
            "kv_scales 0: KV in q's dtype, else float32 [2, KVH] scales of an E4M3 KV");
  m.def(
      "gemv",
      [](uintptr_t x, uintptr_t w, uintptr_t bias, uintptr_t y, int64_t rows, int64_t n, int64_t k, int dtype,
         int device, uintptr_t stream, uintptr_t w_scale) {
        tandem::gemv(reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(w),
                     reinterpret_cast<const void*>(bias), reinterpret_cast<void*>(y), rows, n, k, dtype, device,
                     as_stream(stream), reinterpret_cast<const float*>(w_scale));
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("rows"), py::arg("n"), py::arg("k"),
      py::arg("dtype"), py::arg("device"), py::arg("stream"), py::arg("w_scale") = 0,
      "y[rows, n] = x[rows, k] . w[n, k]^T (+ bias[n]; bias 0: none), rows 1..gemv_max_rows (y written); "
      "w_scale: w is E4M3 at these float32 per-row scales (x bfloat16)");
  m.attr("gemv_fp8") = true;  // this build's gemv takes E4M3 weights
  m.attr("gemv_max_rows") = tandem::kGemvMaxRows;
  m.def(
      "vector_bytes",
      [](uintptr_t src, uintptr_t dst, int64_t row_bytes) {
        return tandem::vector_bytes(reinterpret_cast<const void*>(src), reinterpret_cast<const void*>(dst),
                                    row_bytes);
      },
      "the vector width (bytes) the kernels use for these pointers and row size");

  // ---- devices, memory, streams --------------------------------------------------------------------
  m.def("device_count", [] {
    int n = 0;
    check_rt(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
    return n;
  });
  m.def("pci_bus_id", [](int device) {
    char buf[32] = {0};
    check_rt(cudaDeviceGetPCIBusId(buf, sizeof(buf), device), "cudaDeviceGetPCIBusId");
    return std::string(buf);
  });
  m.def("device_by_pci_bus_id", [](const std::string& bus) {
    int device = -1;
    check_rt(cudaDeviceGetByPCIBusId(&device, bus.c_str()), "cudaDeviceGetByPCIBusId");
    return device;
  });
  m.def("can_access_peer", [](int device, int peer) {
    int ok = 0;
    check_rt(cudaDeviceCanAccessPeer(&ok, device, peer), "cudaDeviceCanAccessPeer");
    return ok != 0;
  });
  m.def(
      "enable_peer_access",
      [](int device, int peer) {
        DeviceScope scope(device);
        cudaError_t err = cudaDeviceEnablePeerAccess(peer, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
          return;
        }
        check_rt(err, "cudaDeviceEnablePeerAccess");
      },
      "let `device` access `peer`'s memory directly (idempotent)");
  m.def("malloc", [](int device, size_t nbytes) {
    DeviceScope scope(device);
    void* p = nullptr;
    check_rt(cudaMalloc(&p, nbytes), "cudaMalloc");
    return reinterpret_cast<uintptr_t>(p);
  });
  m.def("free", [](int device, uintptr_t ptr) {
    DeviceScope scope(device);
    check_rt(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree");
  });
  m.def("memset", [](int device, uintptr_t ptr, int value, size_t nbytes) {
    DeviceScope scope(device);
    check_rt(cudaMemset(reinterpret_cast<void*>(ptr), value, nbytes), "cudaMemset");
    check_rt(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  });
  m.def(
      "copy_to_host",
      [](int device, uintptr_t ptr, size_t nbytes) {
        std::string out(nbytes, '\0');
        {
          py::gil_scoped_release nogil;
          DeviceScope scope(device);
          check_rt(cudaMemcpy(out.data(), reinterpret_cast<void*>(ptr), nbytes, cudaMemcpyDefault), "cudaMemcpy");
        }
        return py::bytes(out);
      },
      "synchronous device -> host copy of `nbytes` at `ptr`");
  m.def(
      "copy_from_host",
      [](int device, uintptr_t ptr, py::bytes data) {
        std::string buf = data;
        py::gil_scoped_release nogil;
        DeviceScope scope(device);
        check_rt(cudaMemcpy(reinterpret_cast<void*>(ptr), buf.data(), buf.size(), cudaMemcpyDefault), "cudaMemcpy");
      },
      "synchronous host -> device copy of `data` to `ptr`");
  m.def(
      "memcpy_async",
      [](int device, uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream) {
        DeviceScope scope(device);
        check_rt(cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes,
                                 cudaMemcpyDefault, as_stream(stream)),
                 "cudaMemcpyAsync");
      },
      "enqueue a copy of `nbytes` (dst written) on `stream` of `device`");
  m.def(
      "stream_synchronize",
      [](uintptr_t stream) {
        py::gil_scoped_release nogil;
        check_rt(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
      },
      "block (GIL released) until all work on `stream` finished; raises if any of it failed");
  m.def("stream_create", [](int device) {
    DeviceScope scope(device);
    cudaStream_t s = nullptr;
    check_rt(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return reinterpret_cast<uintptr_t>(s);
  });
  m.def("stream_destroy", [](uintptr_t stream) {
    check_rt(cudaStreamDestroy(as_stream(stream)), "cudaStreamDestroy");
  });

  // ---- legacy IPC ------------------------------------------------------------------------------------
  m.def(
      "ipc_get_handle",
      [](int device, uintptr_t ptr) {
        DeviceScope scope(device);
        cudaIpcMemHandle_t h;
        check_rt(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)), "cudaIpcGetMemHandle");
        return py::bytes(reinterpret_cast<const char*>(&h), sizeof(h));
      },
      "the 64-byte legacy IPC handle of a cudaMalloc'd base pointer");
  m.def(
      "ipc_open_handle",
      [](int device, py::bytes handle) {
        std::string raw = handle;
        if (raw.size() != sizeof(cudaIpcMemHandle_t)) {
          throw std::invalid_argument("IPC handle must be " + std::to_string(sizeof(cudaIpcMemHandle_t)) +
                                      " bytes, got " + std::to_string(raw.size()));
        }
        cudaIpcMemHandle_t h;
        std::memcpy(&h, raw.data(), sizeof(h));
        void* p = nullptr;
        {
          py::gil_scoped_release nogil;
          DeviceScope scope(device);
          check_rt(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
        }
        return reinterpret_cast<uintptr_t>(p);
      },
      "map another process's allocation into `device`'s context (peer access enabled lazily)");
  m.def("ipc_close_handle", [](int device, uintptr_t ptr) {
    DeviceScope scope(device);
    check_rt(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
  });

  // ---- VMM (cuMem*) ------------------------------------------------------------------------------------
  m.def("vmm_granularity", [](int device, bool fabric) {
    CUmemAllocationProp prop = vmm_prop(device, fabric);
    size_t g = 0;
    check_cu(driver().Granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
             "cuMemGetAllocationGranularity");
    return g;
  });
  m.def(
      "vmm_create",
      [](int device, size_t nbytes, bool fabric) {
        const Driver& d = driver();
        DeviceScope scope(device);
        CUmemAllocationProp prop = vmm_prop(device, fabric);
        CUmemGenericAllocationHandle h = 0;
        check_cu(d.MemCreate(&h, nbytes, &prop, 0), fabric ? "cuMemCreate(FABRIC)" : "cuMemCreate(POSIX_FD)");
        return static_cast<uint64_t>(h);
      },
      "physical memory on `device`, exportable as a FABRIC handle or a POSIX fd");
  m.def("vmm_release", [](uint64_t h) { check_cu(driver().MemRelease(h), "cuMemRelease"); });
  m.def(
      "vmm_export_fd",
      [](uint64_t h) {
        int fd = -1;
        check_cu(driver().MemExport(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                 "cuMemExportToShareableHandle(POSIX_FD)");
        return fd;
      },
      "a new fd (caller owns it) referencing the allocation");
  m.def("vmm_export_fabric", [](uint64_t h) {
    CUmemFabricHandle fh;
    check_cu(driver().MemExport(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0), "cuMemExportToShareableHandle(FABRIC)");
    return py::bytes(reinterpret_cast<const char*>(fh.data), sizeof(fh.data));
  });
  m.def(
      "vmm_import_fd",
      [](int fd) {
        CUmemGenericAllocationHandle h = 0;
        check_cu(driver().MemImport(&h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                 "cuMemImportFromShareableHandle(POSIX_FD)");
        return static_cast<uint64_t>(h);
      },
      "import an exported fd (the fd stays the caller's to close)");
  m.def("vmm_import_fabric", [](py::bytes handle) {
    std::string raw = handle;
    CUmemFabricHandle fh;
    if (raw.size() != sizeof(fh.data)) throw std::invalid_argument("FABRIC handle must be 64 bytes");
    std::memcpy(fh.data, raw.data(), sizeof(fh.data));
    CUmemGenericAllocationHandle h = 0;
    check_cu(driver().MemImport(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC), "cuMemImportFromShareableHandle(FABRIC)");
    return static_cast<uint64_t>(h);
  });
  m.def(
      "vmm_map",
      [](uint64_t h, size_t nbytes, std::vector<int> devices) {
        const Driver& d = driver();
        py::gil_scoped_release nogil;
        CUdeviceptr ptr = 0;
        check_cu(d.AddressReserve(&ptr, nbytes, 0, 0, 0), "cuMemAddressReserve");
        CUresult res = d.Map(ptr, nbytes, 0, h, 0);
        if (res != CUDA_SUCCESS) {
          d.AddressFree(ptr, nbytes);
          check_cu(res, "cuMemMap");
        }
        std::vector<CUmemAccessDesc> access(devices.size());
        for (size_t i = 0; i < devices.size(); ++i) {
          std::memset(&access[i], 0, sizeof(CUmemAccessDesc));
          access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
          access[i].location.id = devices[i];
          access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        }
        res = d.SetAccess(ptr, nbytes, access.data(), access.size());
        if (res != CUDA_SUCCESS) {
          d.Unmap(ptr, nbytes);
          d.AddressFree(ptr, nbytes);
          check_cu(res, "cuMemSetAccess");
        }
        return static_cast<uintptr_t>(ptr);
      },
      "reserve a VA range, map the allocation and grant read/write to `devices`; returns the pointer");
  m.def("vmm_unmap", [](uintptr_t ptr, size_t nbytes) {
    const Driver& d = driver();
    check_cu(d.Unmap(static_cast<CUdeviceptr>(ptr), nbytes), "cuMemUnmap");
    check_cu(d.AddressFree(static_cast<CUdeviceptr>(ptr), nbytes), "cuMemAddressFree");
  });
}
