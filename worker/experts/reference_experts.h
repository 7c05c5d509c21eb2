// An fp32 ExpertBackend on dequantized routed-expert weights: the numerics of transformers' eager
// experts, used as the correctness reference for the model tests and the worker kernels.
#pragma once

#include <memory>
#include <vector>

#include "common/checkpoint.h"
#include "backends/cpu/ops.h"
#include "model/backend.h"

namespace numoe::cpu {

class ReferenceExperts final : public ExpertBackend {
 public:
  // Dequantizes every routed expert of the main layers (fp32: only for small models); with
  // `include_drafter`, also the MTP/DSpark stages' experts as layers num_hidden_layers + stage.
  static StatusOr<std::unique_ptr<ReferenceExperts>> Load(const Checkpoint& ckpt, bool include_drafter = false);
  Status RunRouted(const MoeRequest& request) override;

 private:
  struct Expert {
    Linear w1, w3, w2;
  };
  std::vector<std::vector<Expert>> layers_;
  float limit_ = 0.0f;
};

}  // namespace numoe::cpu
