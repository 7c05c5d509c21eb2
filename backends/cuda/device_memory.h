// Status-returning CUDA error checks and RAII device / pinned host allocations (host side).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "common/status.h"

namespace numoe::cuda {

// cudaErrorMemoryAllocation -> ResourceExhausted, anything else -> Internal; the message names the call site.
Status CudaError(cudaError_t e, const char* what, const char* file, int line);

#define NUMOE_CUDA_RETURN_IF_ERROR(expr)                                                    \
  do {                                                                                      \
    const cudaError_t numoe_cuda_err_ = (expr);                                             \
    if (numoe_cuda_err_ != cudaSuccess) {                                                   \
      return ::numoe::cuda::CudaError(numoe_cuda_err_, #expr, __FILE__, __LINE__);          \
    }                                                                                       \
  } while (0)

// Device memory on the current device, freed on destruction.
class DeviceMem {
 public:
  DeviceMem() = default;
  DeviceMem(DeviceMem&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  DeviceMem& operator=(DeviceMem&& o) noexcept {
    Reset();
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
    return *this;
  }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  ~DeviceMem() { Reset(); }

  // ResourceExhausted naming `what` and the size when the device is full.
  static StatusOr<DeviceMem> Alloc(size_t bytes, const std::string& what);
  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }
  void Reset();

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Page-locked host memory (for asynchronous copies), freed on destruction.
class PinnedMem {
 public:
  PinnedMem() = default;
  PinnedMem(PinnedMem&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  PinnedMem& operator=(PinnedMem&& o) noexcept {
    Reset();
    p_ = std::exchange(o.p_, nullptr);
    n_ = std::exchange(o.n_, 0);
    return *this;
  }
  PinnedMem(const PinnedMem&) = delete;
  PinnedMem& operator=(const PinnedMem&) = delete;
  ~PinnedMem() { Reset(); }

  static StatusOr<PinnedMem> Alloc(size_t bytes, const std::string& what);
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return n_; }
  void Reset();

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace numoe::cuda
