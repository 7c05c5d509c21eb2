// RequestStream: the blocking, RAII way to read one engine request (tests, tools). The engine pushes
// events into it from its scheduling thread; a reader thread takes them with Next()/Wait(). Destroying
// the stream before the request ended cancels it (its sequences are freed).
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "worker/engine/engine.h"

namespace numoe::engine {

class RequestStream {
 public:
  struct Event {
    int32_t choice = 0;
    std::vector<int32_t> tokens;             // new tokens of `choice` (the choice's final event may carry the last)
    std::vector<EmittedLogprobs> logprobs;   // one per token when the request asked for log-probs
    bool final = false;         // the request's last event: every choice finished, or it failed
    bool choice_final = false;  // this choice's last event
    std::string finish_reason;  // choice_final: "stop" | "length" (empty on error)
    Status status;              // final event: the error, if any
  };
  struct Result {
    std::vector<int32_t> tokens;
    std::string finish_reason;
    std::vector<EmittedLogprobs> logprobs;
  };

  // Submits the request; errors are Submit()'s.
  static StatusOr<std::unique_ptr<RequestStream>> Open(Engine* engine, EngineRequest request);
  ~RequestStream();
  RequestStream(const RequestStream&) = delete;
  RequestStream& operator=(const RequestStream&) = delete;

  // Blocks until the next event (the final one repeats once reached).
  Event Next();
  // Non-blocking: true and the event when one is ready.
  bool TryNext(Event* event);
  // Reads to the end: choice 0's tokens, finish reason and log-probs, or the request's error.
  StatusOr<Result> Wait();
  // Reads to the end: every choice's, by index.
  StatusOr<std::vector<Result>> WaitAll();
  RequestId id() const { return id_; }

 private:
  class Sink;
  RequestStream() = default;
  Engine* engine_ = nullptr;
  RequestId id_ = 0;
  std::shared_ptr<Sink> sink_;
};

}  // namespace numoe::engine
