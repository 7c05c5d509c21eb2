// SimExperts: a stand-in for a worker's routed experts, for measuring numoe-gpu with more (or faster)
// workers than the machine has. It loads no weights; each RunRouted waits, sleeping (no spinning, no memory
// traffic), for the time a worker streaming at `gbps` GB/s would take to read the distinct experts the rows
// are routed to (each expert's bytes read once per call, as MoeCompute does), and returns zeros. Expert ids
// outside [0, n_routed_experts) are refused as the real experts refuse them.
// `numoe-worker --sim-expert-gbps G` runs one; with it, one box can stand in for four 100 GB/s NUMA nodes in
// front of a real GPU.
#pragma once

#include <cstdint>

#include "common/config.h"
#include "model/backend.h"

namespace numoe {

class SimExperts final : public ExpertBackend {
 public:
  // Experts of `config`'s size (ExpertBytes) read at `gbps` GB/s (> 0).
  SimExperts(const ModelConfig& config, double gbps)
      : hidden_(config.hidden_size),
        num_experts_(config.n_routed_experts),
        expert_bytes_(ExpertBytes(config)),
        gbps_(gbps) {}
  Status RunRouted(const MoeRequest& request) override;
  // The stored bytes of one routed expert of `config` (w1, w3, w2 with their scales), from the checkpoint
  // footprint arithmetic.
  static int64_t ExpertBytes(const ModelConfig& config);
  // Seconds one call would take for `distinct` experts.
  double Seconds(int64_t distinct) const { return static_cast<double>(distinct * expert_bytes_) / (gbps_ * 1e9); }

 private:
  int64_t hidden_;
  int64_t num_experts_;
  int64_t expert_bytes_;
  double gbps_;
};

}  // namespace numoe
