// numoe-gpu's control plane: worker registrations (each with its channel and serving thread), leases
// kept alive by heartbeats, service figures, and the janitor that frees a worker's sequences and channel
// when its process dies, it stops heartbeating for lease_ms, or it releases itself.
//
// GpuServer holds the logic and is what tests drive; GpuGrpcService (gpu.proto's GpuService on the gRPC
// callback API: every RPC here is short and non-blocking, so it runs on gRPC's own threads) is the edge
// that converts to and from the protos.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/shm_channel.h"
#include "gpu_service/session.h"
#include "numoe/v1/gpu.grpc.pb.h"

namespace numoe::gpu {

struct GpuServerOptions {
  std::string backend = "cpu";     // reported in stats
  std::string fingerprint;         // ModelFingerprint() of the served model; workers must match
  int64_t heartbeat_ms = 500;      // what workers are told to use
  int64_t lease_ms = 0;            // silence that frees a worker; 0 = 4 x heartbeat_ms
  int64_t max_workers = 64;
  int64_t max_step_tokens = 16384; // upper bound on what a worker may ask for (channel size)
  int64_t max_sequences = 1024;
  shm::ChannelOptions channel;
  // Speculative decoding, told to every worker in its channel's geometry: the model drafter (kNone,
  // kDspark or kMtp; the model's drafter()), the most model drafts one entry may ask for (the largest
  // --spec-depth ValidateSpec accepts), and whether the backend verifies drafts (speculative steps and
  // Rollback).
  SpecMethod drafter = SpecMethod::kNone;
  int64_t max_model_drafts = 16;
  bool verify = false;
  // The backend forks sequences (Capabilities::fork): StepRequest forks are served.
  bool fork = false;
  // The drafter's routed experts run in numoe-gpu (told to workers at registration: they skip loading them).
  bool drafter_experts_on_gpu = false;
  // GPU prefill (gpu_service/expert_arena.h): the backend computes routed experts itself (CUDA), and
  // --gpu-prefill-threshold (-1 = calibrate per worker, 0 = never, N = rows per device pass). When both allow
  // it, a worker's expert arena is mapped at registration and attached by its session.
  bool gpu_prefill = false;
  int64_t gpu_prefill_threshold = 0;
  // The prefix cache every worker's sequences share (model/prefix_cache.h); off: --no-prefix-cache.
  bool prefix_cache = true;
  PrefixCacheOptions prefix;
  // Merged passes (gpu_service/merged_step.h): --merge-lanes settled for the backend (MergeEnabled).
  bool merge = false;
};

class GpuServer {
 public:
  // `model` (not owned) must outlive the server; `config` is the model's.
  GpuServer(ModelBackend* model, const ModelConfig& config, const GpuServerOptions& options);
  ~GpuServer();  // Shutdown()

  // Creates the worker's channel and starts serving it. Errors: FAILED_PRECONDITION (model fingerprint
  // differs), INVALID_ARGUMENT (limits; an expert arena that does not fit the model, when GPU prefill would
  // use it), RESOURCE_EXHAUSTED (too many workers). An arena that cannot be opened or mapped only turns GPU
  // prefill off for the worker (logged).
  StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);
  // NOT_FOUND when the lease is unknown (expired, released, or this numoe-gpu restarted).
  Status Heartbeat(uint64_t lease);
  // Frees the worker's sequences and channel (asynchronously, by the janitor). NOT_FOUND when unknown.
  Status Release(uint64_t lease);
  v1::GpuStats Stats() const;
  // Stops every session (workers see their channel closed) and the janitor. Idempotent.
  void Shutdown();

  int64_t lease_ms() const { return options_.lease_ms; }
  ModelHost& host() { return host_; }

 private:
  void Janitor();
  void Reap(std::vector<std::unique_ptr<WorkerSession>>* doomed, const char* why);

  ModelConfig config_;
  GpuServerOptions options_;
  std::unique_ptr<PrefixCache> prefix_cache_;  // outlives the sessions (they leave their sequences in it)
  ModelHost host_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::unique_ptr<WorkerSession>> sessions_;  // guarded by mu_
  std::vector<uint64_t> to_free_;                                // guarded by mu_ (released / exited)
  uint64_t next_lease_ = 1;                                      // guarded by mu_
  bool shutdown_ = false;                                        // guarded by mu_
  std::thread janitor_;
};

// gpu.proto's GpuService over a GpuServer (not owned).
class GpuGrpcService final : public v1::GpuService::CallbackService {
 public:
  explicit GpuGrpcService(GpuServer* server) : server_(server) {}
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::GpuStatsRequest* request,
                                  v1::GpuStats* response) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext* ctx, const v1::ReleaseRequest* request,
                                    v1::ReleaseResponse* response) override;

 private:
  GpuServer* server_;
};

}  // namespace numoe::gpu
