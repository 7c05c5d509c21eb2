#include "worker/experts/reference_experts.h"

#include <algorithm>
#include <cstring>

namespace numoe::cpu {
namespace {

StatusOr<Linear> Load2d(const Checkpoint& ck, const std::string& name) {
  ASSIGN_OR_RETURN(F32Tensor t, ck.LoadF32(name));
  if (t.shape.size() != 2) return absl::InvalidArgumentError(absl::StrCat(name, ": expected a 2-d weight"));
  Linear l;
  l.out = t.shape[0];
  l.in = t.shape[1];
  l.w = std::move(t.data);
  return l;
}

}  // namespace

StatusOr<std::unique_ptr<ReferenceExperts>> ReferenceExperts::Load(const Checkpoint& ckpt, bool include_drafter) {
  const ModelConfig& c = ckpt.config();
  auto r = std::unique_ptr<ReferenceExperts>(new ReferenceExperts());
  r->limit_ = static_cast<float>(c.swiglu_limit);
  const int64_t blocks = c.num_hidden_layers + (include_drafter ? ckpt.mtp_stages() : 0);
  for (int64_t l = 0; l < blocks; ++l) {
    std::vector<Expert> experts;
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const std::string p = RoutedExpertPrefix(c, l, e);
      Expert x;
      ASSIGN_OR_RETURN(x.w1, Load2d(ckpt, p + "w1.weight"));
      ASSIGN_OR_RETURN(x.w3, Load2d(ckpt, p + "w3.weight"));
      ASSIGN_OR_RETURN(x.w2, Load2d(ckpt, p + "w2.weight"));
      experts.push_back(std::move(x));
    }
    r->layers_.push_back(std::move(experts));
  }
  return r;
}

Status ReferenceExperts::RunRouted(const MoeRequest& q) {
  if (q.layer < 0 || q.layer >= static_cast<int64_t>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("RunRouted: layer ", q.layer, " out of range"));
  }
  const auto& experts = layers_[static_cast<size_t>(q.layer)];
  const int64_t D = experts.empty() ? 0 : experts[0].w2.out;
  const int64_t I = experts.empty() ? 0 : experts[0].w1.out;
  std::fill(q.out, q.out + q.rows * D, 0.0f);
  std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I)), o(static_cast<size_t>(D));
  for (int64_t r = 0; r < q.rows; ++r) {
    for (int64_t k = 0; k < q.top_k; ++k) {
      const int32_t e = q.expert_ids[r * q.top_k + k];
      if (e < 0 || e >= static_cast<int32_t>(experts.size())) {
        return absl::InvalidArgumentError(absl::StrCat("RunRouted: expert id ", e, " out of range"));
      }
      const Expert& x = experts[static_cast<size_t>(e)];
      MatMul(q.x + r * D, 1, x.w1, g.data());
      MatMul(q.x + r * D, 1, x.w3, u.data());
      for (int64_t i = 0; i < I; ++i) {
        float gv = g[i], uv = u[i];
        if (limit_ > 0) {
          gv = std::min(gv, limit_);
          uv = std::clamp(uv, -limit_, limit_);
        }
        g[i] = Silu(gv) * uv;
      }
      MatMul(g.data(), 1, x.w2, o.data());
      const float w = q.expert_weights[r * q.top_k + k];
      for (int64_t d = 0; d < D; ++d) q.out[r * D + d] += w * o[d];
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe::cpu
