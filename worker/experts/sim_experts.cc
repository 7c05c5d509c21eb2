#include "worker/experts/sim_experts.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "common/checkpoint.h"

namespace numoe {

int64_t SimExperts::ExpertBytes(const ModelConfig& config) {
  const ModelFootprint f = ComputeFootprint(config, 0);
  const int64_t experts = config.num_hidden_layers * config.n_routed_experts;
  return experts > 0 ? f.routed_expert_bytes / experts : 0;
}

Status SimExperts::RunRouted(const MoeRequest& r) {
  if (r.rows < 0 || r.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoE layer ", r.layer, ": rows ", r.rows, ", top_k ", r.top_k));
  }
  const int64_t routes = r.rows * r.top_k;
  if ((routes > 0 && r.expert_ids == nullptr) || (r.rows > 0 && r.out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat("MoE layer ", r.layer, ": null expert_ids or out"));
  }
  std::vector<int32_t> ids(r.expert_ids, r.expert_ids + routes);
  for (int64_t i = 0; i < routes; ++i) {
    if (ids[i] < 0 || ids[i] >= num_experts_) {
      return absl::InvalidArgumentError(absl::StrCat("MoE layer ", r.layer, ": expert_ids[", i / r.top_k, "][",
                                                     i % r.top_k, "] = ", ids[i], " is not in [0, ", num_experts_,
                                                     ")"));
    }
  }
  std::sort(ids.begin(), ids.end());
  const int64_t distinct = std::unique(ids.begin(), ids.end()) - ids.begin();
  if (r.rows > 0) {
    std::memset(r.out, 0, static_cast<size_t>(r.rows) * static_cast<size_t>(hidden_) * sizeof(float));
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(Seconds(distinct)));
  return absl::OkStatus();
}

}  // namespace numoe
