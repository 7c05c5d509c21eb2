// Every kernel the CUDA backend runs between StartKernelProfile and StopKernelProfile, with its device time
// (CUPTI's activity API; libcupti is loaded at run time, so nothing links it and only a profile needs it), and,
// for launches that say what they move (launch_note.h; the GEMM launcher: the weight's type and shape, the rows,
// the bytes read and written), that note (CUPTI external correlation ids). Launches replayed from a CUDA graph
// carry the graph launch's correlation, not their own: profile with CudaOptions::graphs off to get the notes.
// One profile per process at a time.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backends/cuda/launch_note.h"
#include "common/status.h"

namespace numoe::cuda {

struct KernelRecord {
  std::string kernel;  // demangled name, template arguments and parameters dropped
  std::string what;    // the launcher's note ("" when it gave none)
  int64_t bytes = 0;   // bytes the launch reads and writes, from the note (0: unknown)
  uint64_t start_ns = 0, end_ns = 0;
  int32_t grid_x = 0, grid_y = 0, grid_z = 0;
};

// Loads libcupti (NUMOE_CUPTI names the file; else libcupti.so.13, libcupti.so and the CUDA toolkit's copy) and
// starts recording kernels. FailedPrecondition when a profile is already running; Unavailable without libcupti
// or without CUDA.
Status StartKernelProfile();
// Flushes and returns the records, sorted by start time.
StatusOr<std::vector<KernelRecord>> StopKernelProfile();

}  // namespace numoe::cuda
