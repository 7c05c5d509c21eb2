#include "gpu_service/shm_experts.h"

#include <algorithm>
#include <cstring>

#include "common/clock.h"

namespace numoe::gpu {

Status ShmExpertBackend::RunRouted(const MoeRequest& r) {
  RETURN_IF_ERROR(Post(r));
  if (r.rows == 0) return absl::OkStatus();
  if (yield_ != nullptr) yield_->unlock();
  Status st = Collect(r);
  if (yield_ != nullptr) Relock();
  return st;
}

Status ShmExpertBackend::Post(const MoeRequest& r) {
  RETURN_IF_ERROR(broken_);
  const shm::Geometry& g = ch_->geometry();
  if (r.rows < 0 || r.rows > g.max_rows || r.top_k < 1 || r.top_k > g.top_k) {
    return absl::InternalError(absl::StrCat("MoE layer ", r.layer, ": rows ", r.rows, " / top_k ", r.top_k,
                                            " do not fit the worker channel (max_rows ", g.max_rows, ", top_k ",
                                            g.top_k, ")"));
  }
  if (r.rows == 0) return absl::OkStatus();
  const size_t D = g.hidden;
  const size_t rows = static_cast<size_t>(r.rows), routes = rows * static_cast<size_t>(r.top_k);
  std::memcpy(ch_->moe_x(), r.x, rows * D * sizeof(float));
  std::memcpy(ch_->moe_ids(), r.expert_ids, routes * sizeof(int32_t));
  std::memcpy(ch_->moe_weights(), r.expert_weights, routes * sizeof(float));
  shm::MsgHeader& m = ch_->outgoing();
  m.layer = r.layer;
  m.rows = r.rows;
  m.top_k = r.top_k;
  posted_ns_ = SteadyNanos();
  if (Status st = ch_->Send(shm::MsgType::kMoeRequest); !st.ok()) return broken_ = st;
  return absl::OkStatus();
}

Status ShmExpertBackend::Collect(const MoeRequest& r) {
  RETURN_IF_ERROR(broken_);
  if (r.rows == 0) return absl::OkStatus();
  const size_t D = ch_->geometry().hidden, rows = static_cast<size_t>(r.rows);
  auto type = ch_->Receive(-1);
  const int64_t rtt = SteadyNanos() - posted_ns_;
  if (!type.ok()) return broken_ = type.status();
  const shm::MsgHeader& in = ch_->incoming();
  if (*type == shm::MsgType::kError) {
    // The worker's experts failed; the conversation is intact (the step's final Error answers it).
    Status st = ch_->IncomingError();
    return Status(st.code(), absl::StrCat("worker: ", st.message()));
  }
  if (*type != shm::MsgType::kMoeResponse || in.layer != r.layer || in.rows != r.rows) {
    return broken_ = absl::DataLossError(absl::StrCat("expected the MoeResponse for layer ", r.layer, " (", r.rows,
                                                      " rows), got ", shm::MsgTypeName(*type), " layer ", in.layer,
                                                      " rows ", in.rows));
  }
  std::memcpy(r.out, ch_->moe_out(), rows * D * sizeof(float));
  // compute_ns comes from the worker: clamped to [0, rtt] (a hostile value must not overflow the subtraction).
  const int64_t compute_ns = std::clamp<int64_t>(in.compute_ns, 0, rtt);
  if (hops_ != nullptr) hops_->Add(static_cast<double>(rtt - compute_ns) * 1e-3);
  return absl::OkStatus();
}

}  // namespace numoe::gpu
