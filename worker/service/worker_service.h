// worker.proto's Worker service over the batching engine.
//
// Why the callback API: a Generate stream spends nearly all its life waiting for the next token, which
// the engine's scheduling thread produces. With callbacks no thread is held per stream (a worker may
// serve hundreds), the engine pushes tokens straight into the stream's reactor, and a client that goes
// away is an OnCancel that cancels the request in the engine (its sequence is freed in numoe-gpu).
#pragma once

#include <string>
#include <vector>

#include "numoe/v1/worker.grpc.pb.h"
#include "worker/engine/engine.h"

namespace numoe::worker {

struct WorkerServiceOptions {
  std::string worker_id;
  std::vector<int> numa_nodes;
  int64_t default_max_tokens = 256;  // for requests with max_new_tokens = 0
};

// Converts a WorkerGenerateRequest (proto3 zeros mean "unset": top_p 0 -> 1). Errors name the field.
StatusOr<engine::EngineRequest> ToEngineRequest(const v1::WorkerGenerateRequest& request, int64_t default_max_tokens);

class WorkerGrpcService final : public v1::Worker::CallbackService {
 public:
  // `engine` (not owned) must outlive the gRPC server.
  WorkerGrpcService(engine::Engine* engine, WorkerServiceOptions options)
      : engine_(engine), options_(std::move(options)) {}

  grpc::ServerWriteReactor<v1::WorkerGenerateResponse>* Generate(grpc::CallbackServerContext* ctx,
                                                                 const v1::WorkerGenerateRequest* request) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::WorkerStatsRequest* request,
                                  v1::WorkerStats* response) override;

 private:
  engine::Engine* engine_;
  WorkerServiceOptions options_;
};

}  // namespace numoe::worker
