// How the balancer talks to one worker: a small interface so tests can drive the balancer with in-process
// fake workers, and the router uses the gRPC implementation (grpc_worker_client.h).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>

#include "common/status.h"
#include "numoe/v1/worker.pb.h"

namespace numoe::router {

// Receives one worker call's events. OnResponse is called zero or more times (one per streamed message:
// token ids of one choice, their log-probs, the choice's finish_reason on its last one), then OnEnd exactly
// once; calls of one WorkerCall never overlap, but may come from any thread.
class WorkerCallSink {
 public:
  virtual ~WorkerCallSink() = default;
  virtual void OnResponse(const v1::WorkerGenerateResponse& response) = 0;
  // status OK: the sequence finished normally (finish_reason of the last message, "" if none was sent).
  virtual void OnEnd(const Status& status) = 0;
};

// One in-flight Generate call.
class WorkerCall {
 public:
  virtual ~WorkerCall() = default;
  // Asks the worker to stop; OnEnd still follows (with CANCELLED, or OK when it had already finished).
  virtual void Cancel() = 0;
};

class WorkerClient {
 public:
  virtual ~WorkerClient() = default;
  // Starts Generate; the sink is kept alive until OnEnd returns. timeout_seconds > 0 bounds the whole call
  // (then OnEnd gets DeadlineExceeded).
  virtual std::shared_ptr<WorkerCall> Generate(const v1::WorkerGenerateRequest& request, double timeout_seconds,
                                               std::shared_ptr<WorkerCallSink> sink) = 0;
  // Asynchronous Stats with a deadline; `done` runs once, on any thread.
  virtual void Stats(double timeout_seconds, std::function<void(StatusOr<v1::WorkerStats>)> done) = 0;
};

}  // namespace numoe::router
