// ShmExpertBackend: numoe-gpu's ExpertBackend for one worker. Each RunRouted copies the layer's MoE rows,
// expert ids and weights into the worker's channel, rings it, and waits for the expert sum (the worker
// computes it while this thread spins, then sleeps on the futex). The transport overhead of every hop
// (round trip minus the worker's reported compute time) goes into a LatencyRecorder.
#pragma once

#include "common/shm_channel.h"
#include "model/backend.h"
#include "gpu_service/fifo_mutex.h"
#include "gpu_service/latency.h"

namespace numoe::gpu {

class ShmExpertBackend final : public ExpertBackend {
 public:
  // Not owned; `channel` is the gpu side.
  ShmExpertBackend(shm::Channel* channel, LatencyRecorder* hops, int lane = 0, bool background = false)
      : ch_(channel), hops_(hops), lane_(lane), background_(background) {}
  // Post + Collect, giving up the model (set_yield) while the worker computes.
  Status RunRouted(const MoeRequest& request) override;
  // The two halves of RunRouted, so that a merged pass (gpu_service/merged_step.h) posts every worker's
  // rows before it waits for any: Post copies the rows into the channel and rings the worker; Collect waits
  // for its answer and copies the expert sum into request.out. Neither touches the yield mutex. Collect
  // after an OK Post with the same request (rows 0: both are no-ops).
  Status Post(const MoeRequest& request);
  Status Collect(const MoeRequest& request);
  int lane() const override { return lane_; }
  int64_t hidden() const { return ch_->geometry().hidden; }
  // GPU prefill: the worker's experts as numoe-gpu mapped them (not owned; null = none), for the model backend.
  const HostExperts* host_experts() const override { return host_experts_; }
  void set_host_experts(const HostExperts* experts) { host_experts_ = experts; }
  // While waiting for the worker's answer, unlock `held` (the caller holds it) and lock it again before
  // returning: other lanes use the model meanwhile. nullptr = keep holding.
  void set_yield(FifoMutex* held) { yield_ = held; }
  // A background session (a worker's prefill lane, RegisterRequest::prefill_lane) takes the model back
  // with FifoMutex::lock_background: the decode lanes waiting go first.
  bool background() const override { return background_; }
  bool WantsYield() const override { return yield_ != nullptr; }
  Status YieldModel(const std::function<Status()>& meanwhile) override {
    if (yield_ == nullptr) return meanwhile();
    yield_->unlock();
    Status st = meanwhile();
    Relock();
    return st;
  }
  void Relock() {
    if (background_) {
      yield_->lock_background();
    } else {
      yield_->lock();
    }
  }
  // The channel failed (peer gone, protocol violation): the conversation cannot continue.
  bool broken() const { return !broken_.ok(); }
  const Status& broken_status() const { return broken_; }

 private:
  shm::Channel* ch_;
  LatencyRecorder* hops_;
  Status broken_;
  FifoMutex* yield_ = nullptr;
  int lane_ = 0;
  bool background_ = false;
  int64_t posted_ns_ = 0;  // when the last Post rang the worker
  const HostExperts* host_experts_ = nullptr;
};

}  // namespace numoe::gpu
