// GPU prefill, numoe-gpu's side of a worker's expert arena: the description the worker registers with
// (ExpertArenaSpec, from gpu.proto's ExpertArena), checked against the served model, and the arena mapped into
// this process as HostExperts (model/backend.h) for the model backend to register for DMA and stream from.
//
// The arena is the worker's sealed memfd (common/numa.h SharedArena); numoe-gpu opens it as
// /proc/<pid>/fd/<fd> (same host, same user: what the shared-memory channel already needs), checks that it is
// sealed against shrinking (so it can never shrink under the mapping) and as large as announced, and maps it
// read-only; writable only where the GPU cannot register read-only host memory (numoe-gpu never writes it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "model/backend.h"

namespace numoe::gpu {

struct ExpertArenaSpec {
  uint32_t pid = 0;
  int64_t fd = -1;
  int64_t bytes = 0;
  int64_t num_experts = 0, hidden = 0, inter = 0, stride = 0;
  std::vector<int64_t> layer_offsets;  // [num_hidden_layers]
};

// InvalidArgument naming the field (expert_arena.<field>) when `spec` does not fit `config`: the shapes
// (n_routed_experts, hidden_size, moe_intermediate_size), the packed layout's stride, one offset per main layer,
// each 4 KiB-aligned with its layer inside `bytes`, a descriptor number >= 0, a size > 0.
Status ValidateExpertArena(const ExpertArenaSpec& spec, const ModelConfig& config);

// The smallest rows per device pass at which computing a layer's experts on the GPU pays:
// rows x row_seconds > layer_bytes / (h2d_gbps GB/s). 0 (never) when either speed is unknown (<= 0).
int64_t CalibratedPrefillRows(int64_t layer_bytes, double h2d_gbps, double row_seconds);

class MappedExpertArena {
 public:
  // Validates `spec` (ValidateExpertArena), opens and checks the file, maps it. InvalidArgument for the spec;
  // FailedPrecondition when the file cannot be opened, is no memfd sealed against shrinking, or has another
  // size; Internal when mmap fails.
  static StatusOr<std::unique_ptr<MappedExpertArena>> Map(const ExpertArenaSpec& spec, const ModelConfig& config,
                                                          bool writable = false);
  // The same file mapped once more (the spec is not checked again), e.g. writable.
  StatusOr<std::unique_ptr<MappedExpertArena>> Reopen(bool writable) const;
  ~MappedExpertArena();  // unmaps: detach it from the model backend first
  MappedExpertArena(const MappedExpertArena&) = delete;
  MappedExpertArena& operator=(const MappedExpertArena&) = delete;

  const ExpertArenaSpec& spec() const { return spec_; }
  bool writable() const { return writable_; }
  // One region (the whole file); min_rows is the owner's (0 until it sets it).
  HostExperts* host_experts() { return &host_; }

 private:
  MappedExpertArena() = default;
  static StatusOr<std::unique_ptr<MappedExpertArena>> MapChecked(const ExpertArenaSpec& spec, bool writable);
  ExpertArenaSpec spec_;
  bool writable_ = false;
  void* base_ = nullptr;
  size_t size_ = 0;
  HostExperts host_;
};

}  // namespace numoe::gpu
