// The worker's control-plane link to numoe-gpu: Register (retried while numoe-gpu is still starting),
// a heartbeat thread that keeps the lease alive, and Release on the way out. The data plane (the
// shared-memory channel named in the registration) is attached by the caller.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "numoe/v1/gpu.grpc.pb.h"

namespace numoe::worker {

class GpuClient {
 public:
  // Registers with numoe-gpu at `address` (host:port). UNAVAILABLE answers (not up yet) are retried with
  // backoff for up to `wait_ms`; other errors (e.g. a different model) return at once.
  static StatusOr<std::unique_ptr<GpuClient>> Register(const std::string& address, const v1::RegisterRequest& request,
                                                       int64_t wait_ms);
  ~GpuClient();  // stops heartbeats (does not Release)

  const v1::RegisterResponse& registration() const { return registration_; }

  // Heartbeats every registration().heartbeat_ms(). The lease is lost when numoe-gpu answers NOT_FOUND
  // or stays unreachable for lease_ms: then lost() turns true.
  void StartHeartbeats();
  bool lost() const { return lost_.load(); }
  Status lost_status() const;

  // Frees the registration on numoe-gpu now (best effort, 2 s deadline).
  Status Release();

 private:
  GpuClient() = default;
  void HeartbeatLoop();

  std::unique_ptr<v1::GpuService::Stub> stub_;
  v1::RegisterResponse registration_;
  std::thread thread_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> lost_{false};
  Status lost_status_;
};

}  // namespace numoe::worker
