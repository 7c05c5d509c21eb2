// One Anthropic Messages request (POST /v1/messages) in flight: its one choice runs through the Frontend
// like a chat completion's; the generated text goes through the one output parser (openai::ChatStreamParser)
// and anthropic::MessageBuilder, and the answer is a whole message or Anthropic's server-sent events
// (message_start, ping, content_block_start / _delta / _stop, message_delta, message_stop). A failure before
// the first event is an HTTP error in Anthropic's shape; after it, an "error" event ends the stream.
//
// Thread-safety: the choice's events arrive on worker threads; one mutex orders them.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "router/anthropic/messages.h"
#include "router/core/frontend.h"
#include "router/http/exchange.h"
#include "router/openai/chat.h"

namespace numoe::router {

class MessagesJob : public std::enable_shared_from_this<MessagesJob> {
 public:
  struct Config {
    bool stream = false;
    bool thinking = false;  // the prompt starts the output in reasoning
    bool tools = false;     // tools were rendered
    bool disable_parallel_tool_use = false;
    std::string model;
    std::string id;  // "msg_...", also the workers' request_id
  };

  MessagesJob(Config config, std::shared_ptr<HttpExchange> exchange);

  // Starts the choice; an admission error (no worker, queue full) is answered at once.
  void Start(Frontend& frontend, ChoiceSpec spec);

 private:
  struct Sink;
  void OnEvent(ChoiceEvent ev);
  void Cancel();
  void SendEventsLocked(const std::vector<anthropic::Json>& events);
  void SendErrorLocked(const Status& status);

  const Config config_;
  std::shared_ptr<HttpExchange> exchange_;

  std::mutex mu_;
  openai::ChatStreamParser parser_;
  anthropic::MessageBuilder builder_;
  std::shared_ptr<ChoiceRun> run_;
  uint64_t input_tokens_ = 0;
  uint64_t output_tokens_ = 0;
  bool begun_ = false;    // the builder has its message_start
  bool started_ = false;  // message_start went out (streaming): errors become an error event
  bool done_ = false;     // answered (or the client left): later events are ignored
};

// Sends `status` as an Anthropic error response (with Retry-After for 429/503).
void RespondAnthropicError(HttpExchange& exchange, const Status& status);

}  // namespace numoe::router
