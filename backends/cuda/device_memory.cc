#include "backends/cuda/device_memory.h"


namespace numoe::cuda {

Status CudaError(cudaError_t e, const char* what, const char* file, int line) {
  const std::string msg = absl::StrCat("CUDA error ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ") in ", what,
                                       " at ", file, ":", line);
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return absl::UnavailableError(msg);
  return absl::InternalError(msg);
}

StatusOr<DeviceMem> DeviceMem::Alloc(size_t bytes, const std::string& what) {
  DeviceMem m;
  if (bytes == 0) return m;
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free allocation error
    size_t free_b = 0, total_b = 0;
    (void)cudaMemGetInfo(&free_b, &total_b);
    return absl::ResourceExhaustedError(absl::StrCat("device memory exhausted allocating ", what, ": ",
                                                     bytes >> 20, " MiB requested, ", free_b >> 20, " MiB free of ",
                                                     total_b >> 20, " MiB (", cudaGetErrorString(e), ")"));
  }
  m.p_ = p;
  m.n_ = bytes;
  return m;
}

void DeviceMem::Reset() {
  if (p_ != nullptr) (void)cudaFree(p_);
  p_ = nullptr;
  n_ = 0;
}

StatusOr<PinnedMem> PinnedMem::Alloc(size_t bytes, const std::string& what) {
  PinnedMem m;
  if (bytes == 0) return m;
  void* p = nullptr;
  const cudaError_t e = cudaMallocHost(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("pinned host memory exhausted allocating ", what, ": ", bytes >> 20, " MiB (", cudaGetErrorString(e), ")"));
  }
  m.p_ = p;
  m.n_ = bytes;
  return m;
}

void PinnedMem::Reset() {
  if (p_ != nullptr) (void)cudaFreeHost(p_);
  p_ = nullptr;
  n_ = 0;
}

}  // namespace numoe::cuda
