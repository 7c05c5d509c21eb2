// InProcessExperts: the worker's routed-expert computation as an ExpertBackend linked into the same
// process as the model (`numoe generate`, tests, the worker side of the shared-memory channel).
// Every main layer's MXFP4 experts are repacked at load (ExpertLayer::Pack) and run with MoeCompute on
// the given pool, with the ISA chosen by SelectIsa() (NUMOE_ISA overrides) unless one is given.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "common/checkpoint.h"
#include "model/backend.h"
#include "worker/experts/expert_layer.h"
#include "worker/experts/isa.h"
#include "worker/experts/moe_compute.h"

namespace numoe {

class ThreadPool;

struct InProcessExpertsOptions {
  std::optional<Isa> isa;  // default: SelectIsa()
  int numa_node = -1;      // memory node for the packed experts (-1: default policy)
  bool include_drafter = false;  // also the MTP/DSpark stages' experts, as layers num_hidden_layers + stage
  // Called after each layer is packed: (layers done, layers total, bytes packed so far).
  std::function<void(int64_t, int64_t, int64_t)> progress;
  // Pack every layer into one sealed memfd (common/numa.h SharedArena) that numoe-gpu can map for GPU prefill
  // (arena(), host_experts()); else each layer is an anonymous mapping of its own.
  bool shared_arena = false;
};

class InProcessExperts final : public ExpertBackend {
 public:
  // `pool` (not owned) runs both the repacking and the kernels; it must outlive this object.
  static StatusOr<std::unique_ptr<InProcessExperts>> Load(const Checkpoint& ckpt, ThreadPool* pool,
                                                          const InProcessExpertsOptions& options = {});
  Status RunRouted(const MoeRequest& request) override;
  Isa isa() const { return compute_->isa(); }
  int64_t bytes() const;  // packed expert bytes held
  // The main layers as HostExperts (one region per layer), for a model backend in this process that
  // computes large steps' experts itself (ModelBackend::AttachHostExperts; tests, numoe generate).
  // HostExperts::min_rows starts at 0 (never): the caller sets it.
  const HostExperts* host_experts() const override { return &host_; }
  HostExperts* mutable_host_experts() { return &host_; }
  // With shared_arena: the sealed memfd holding every layer, and the main layers' offsets in it
  // ([num_hidden_layers]); null and empty otherwise.
  const SharedArena* arena() const { return arena_.get(); }
  const std::vector<int64_t>& arena_offsets() const { return arena_offsets_; }

 private:
  InProcessExperts() = default;
  std::unique_ptr<SharedArena> arena_;
  std::vector<int64_t> arena_offsets_;
  HostExperts host_;
  std::vector<std::unique_ptr<ExpertLayer>> layers_;
  std::unique_ptr<MoeCompute> compute_;
  float swiglu_limit_ = 0.0f;
};

}  // namespace numoe
