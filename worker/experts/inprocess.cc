#include "worker/experts/inprocess.h"

#include <string>

#include "common/thread_pool.h"

namespace numoe {
namespace {

StatusOr<Mxfp4Matrix> View(const Checkpoint& ck, const std::string& weight, int64_t rows, int64_t cols) {
  ASSIGN_OR_RETURN(const TensorView* w, ck.Raw(weight));
  const std::string scale_name = weight.substr(0, weight.size() - std::string("weight").size()) + "scale";
  ASSIGN_OR_RETURN(const TensorView* s, ck.Raw(scale_name));
  if (w->dtype != DType::kI8 && w->dtype != DType::kU8) {
    return absl::InvalidArgumentError(absl::StrCat(weight, ": routed experts must be MXFP4 (I8/U8 packed), got ",
                                                   std::string(DTypeName(w->dtype))));
  }
  if (s->dtype != DType::kF8_E8M0) {
    return absl::InvalidArgumentError(absl::StrCat(scale_name, ": expected F8_E8M0 scales"));
  }
  if (w->numel() != rows * cols / 2 || s->numel() != rows * ((cols + 31) / 32)) {
    return absl::InvalidArgumentError(
        absl::StrCat(weight, ": stored shape ", w->ShapeString(), " does not hold [", rows, ", ", cols, "] MXFP4"));
  }
  return Mxfp4Matrix{w->data, s->data, rows, cols};
}

}  // namespace

StatusOr<std::unique_ptr<InProcessExperts>> InProcessExperts::Load(const Checkpoint& ck, ThreadPool* pool,
                                                                   const InProcessExpertsOptions& options) {
  const ModelConfig& c = ck.config();
  if (c.expert_dtype != "fp4") {
    return absl::UnimplementedError(absl::StrCat("expert_dtype '", c.expert_dtype,
                                                 "': the CPU expert kernels support MXFP4 (fp4) experts only"));
  }
  Isa isa;
  if (options.isa.has_value()) {
    isa = *options.isa;
  } else {
    ASSIGN_OR_RETURN(isa, SelectIsa());
  }
  auto r = std::unique_ptr<InProcessExperts>(new InProcessExperts());
  r->swiglu_limit_ = static_cast<float>(c.swiglu_limit);
  const int64_t D = c.hidden_size, I = c.moe_intermediate_size;
  int64_t bytes = 0;
  const int64_t blocks = c.num_hidden_layers + (options.include_drafter ? ck.mtp_stages() : 0);
  const experts::PackedExpertShape shape{D, I};
  if (options.shared_arena) {
    ASSIGN_OR_RETURN(r->arena_, SharedArena::Create("numoe-experts",
                                                    static_cast<size_t>(blocks * c.n_routed_experts * shape.stride())));
  }
  for (int64_t l = 0; l < blocks; ++l) {
    std::vector<ExpertWeightsRef> refs;
    refs.reserve(static_cast<size_t>(c.n_routed_experts));
    for (int64_t e = 0; e < c.n_routed_experts; ++e) {
      const std::string p = RoutedExpertPrefix(c, l, e);
      ExpertWeightsRef ref;
      ASSIGN_OR_RETURN(ref.w1, View(ck, p + "w1.weight", I, D));
      ASSIGN_OR_RETURN(ref.w3, View(ck, p + "w3.weight", I, D));
      ASSIGN_OR_RETURN(ref.w2, View(ck, p + "w2.weight", D, I));
      refs.push_back(ref);
    }
    ExpertPackOptions po;
    po.numa_node = options.numa_node;
    po.pool = pool;
    po.arena = r->arena_.get();
    ASSIGN_OR_RETURN(std::unique_ptr<ExpertLayer> layer, ExpertLayer::Pack(D, I, refs, isa, po));
    bytes += static_cast<int64_t>(layer->bytes());
    if (l < c.num_hidden_layers) {
      r->host_.regions.push_back({layer->expert_data(0), static_cast<int64_t>(layer->bytes())});
      r->host_.layers.push_back(layer->expert_data(0));
      if (r->arena_ != nullptr) r->arena_offsets_.push_back(layer->arena_offset());
    }
    r->layers_.push_back(std::move(layer));
    if (options.progress) options.progress(l + 1, blocks, bytes);
  }
  if (r->arena_ != nullptr) RETURN_IF_ERROR(r->arena_->Seal());
  r->host_.num_experts = c.n_routed_experts;
  r->host_.hidden = D;
  r->host_.inter = I;
  r->host_.stride = shape.stride();
  r->compute_ = std::make_unique<MoeCompute>(pool, isa);
  return r;
}

int64_t InProcessExperts::bytes() const {
  int64_t b = 0;
  for (const auto& l : layers_) b += static_cast<int64_t>(l->bytes());
  return b;
}

Status InProcessExperts::RunRouted(const MoeRequest& q) {
  if (q.layer < 0 || q.layer >= static_cast<int64_t>(layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("RunRouted: layer ", q.layer, " is out of range [0, ",
                                                   layers_.size(), ")"));
  }
  MoeBatch b;
  b.rows = q.rows;
  b.top_k = q.top_k;
  b.x = q.x;
  b.expert_ids = q.expert_ids;
  b.expert_weights = q.expert_weights;
  b.out = q.out;
  return compute_->Run(*layers_[static_cast<size_t>(q.layer)], swiglu_limit_, b);
}

}  // namespace numoe
