// One MoE layer's routed experts, repacked once at load into the kernels' layout (packed_layout.h) in a
// node-local buffer on 2 MB pages. Immutable after Pack; safe to share between threads.
//
//   std::vector<ExpertWeightsRef> refs(256);   // views of the checkpoint, e.g. Checkpoint::Raw(...)
//   ASSIGN_OR_RETURN(auto layer, ExpertLayer::Pack(4096, 2048, refs, isa, {.numa_node = placement.memory_node}));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/numa.h"
#include "common/status.h"
#include "worker/experts/isa.h"
#include "common/packed_layout.h"

namespace numoe {

class ThreadPool;

// A checkpoint MXFP4 matrix, viewed (not owned); see packed_layout.h for the format.
struct Mxfp4Matrix {
  const uint8_t* packed = nullptr;  // [rows, cols / 2]: byte k holds column 2k (low nibble) and 2k+1 (high)
  const uint8_t* scales = nullptr;  // [rows, ceil(cols / 32)] E8M0
  int64_t rows = 0, cols = 0;       // logical [out, in]; cols must be even
};

// One expert: gate w1 [inter, hidden], up w3 [inter, hidden], down w2 [hidden, inter].
struct ExpertWeightsRef {
  Mxfp4Matrix w1, w3, w2;
};

struct ExpertPackOptions {
  int numa_node = -1;          // memory node (NumaPlacement::memory_node); -1 = the kernel's default policy
  bool huge_pages = true;      // 2 MB pages when the system allows (numa.h AllocateOnNode)
  ThreadPool* pool = nullptr;  // repack on these threads (the kernel pool: pages are first touched locally)
  // Allocate the layer in this shared arena (a slice of its memfd, bound to numa_node) instead of an anonymous
  // mapping, so that numoe-gpu can map it (GPU prefill); huge_pages is then the arena's choice.
  SharedArena* arena = nullptr;
};

class ExpertLayer {
 public:
  // Validates and repacks `experts` (all of the same shape). Errors name the expert and matrix: null
  // pointers, shapes other than the ones above, odd columns, NaN scales (E8M0 0xFF). `isa` must be
  // available here (IsaAvailable); all ISAs share one layout, so a layer packed for one runs on any.
  static StatusOr<std::unique_ptr<ExpertLayer>> Pack(int64_t hidden, int64_t inter,
                                                     const std::vector<ExpertWeightsRef>& experts, Isa isa,
                                                     const ExpertPackOptions& options = {});

  int64_t num_experts() const { return num_experts_; }
  int64_t hidden() const { return shape_.hidden; }
  int64_t inter() const { return shape_.inter; }
  size_t bytes() const { return buffer_.size(); }  // memory held, padding and alignment included
  Isa isa() const { return isa_; }

  const experts::PackedExpertShape& shape() const { return shape_; }
  // Bytes one Run streams for each expert it uses (the checkpoint's bytes for 128-aligned shapes).
  int64_t expert_stream_bytes() const { return shape_.data_bytes(); }
  const uint8_t* expert_data(int64_t e) const { return buffer_.data() + e * shape_.stride(); }
  // True when every scale byte is in [2, 252], so weights are exact in bf16 (the AMX kernel's condition).
  bool bf16_exact() const { return bf16_exact_; }
  const std::string& page_mode() const { return buffer_.page_mode(); }
  // The layer's offset in ExpertPackOptions::arena's file (-1: not in an arena).
  int64_t arena_offset() const { return arena_offset_; }

 private:
  ExpertLayer() = default;
  int64_t num_experts_ = 0;
  experts::PackedExpertShape shape_;
  Isa isa_ = Isa::kGeneric;
  bool bf16_exact_ = true;
  int64_t arena_offset_ = -1;
  NodeBuffer buffer_;
};

}  // namespace numoe
