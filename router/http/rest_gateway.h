// The REST API on top of the Frontend: OpenAI-compatible, plus vLLM's tokenizer endpoints and the
// Anthropic Messages API (router/anthropic/messages.h, the same chat encoder and generation path):
//   POST /v1/completions        prompt as text, token ids, or a list of either (one choice each)
//   POST /v1/chat/completions   DeepSeek V4 chat encoding, reasoning_content / content / tool_calls
//   POST /v1/messages           Anthropic Messages: thinking / text / tool_use blocks, Anthropic's SSE events
//   POST /v1/messages/count_tokens  {"input_tokens": N} for a Messages body
//   POST /tokenize              vLLM: "prompt" (as a completion tokenizes it) or "messages" (+ tools, thinking;
//                               the chat encoding) -> {"count", "max_model_len", "tokens", "token_strs"}
//   POST /detokenize            vLLM: {"tokens": [...]} -> {"prompt": text} (special tokens kept)
//   GET  /v1/models             the served model
//   GET  /health                200 {"status":"ok",...} when at least one worker is up, else 503
//   GET  /metrics               Prometheus text (metrics.h)
// "stream": true answers with server-sent events in OpenAI's chunk shapes, ending with "data: [DONE]";
// a failure after the stream started is sent as a {"error": {...}} event, then [DONE].
// A prompt longer than the context is 400 with param "prompt" (or "messages"); a body over
// max_body_bytes is 413 (checked by the HTTP server before the body is read).
// With API keys set, every endpoint except /health needs "Authorization: Bearer <key>" or "x-api-key: <key>"
// (else 401). Errors on /v1/messages* are in Anthropic's shape, elsewhere in OpenAI's; the status codes are
// the same. With return_token_ids, responses also carry prompt_token_ids (vLLM's shape: on a chat response
// and its first chunk, on each completion choice and its first chunk).
//
// Thread-safety: Handle() may be called from any number of threads at once.
#pragma once

#include <memory>
#include <string>

#include "router/balancer/balancer.h"
#include "router/core/api_keys.h"
#include "router/core/frontend.h"
#include "router/http/exchange.h"
#include "router/metrics/metrics.h"

namespace numoe::router {

namespace openai {
class ChatEncoder;
}

struct RestGatewayOptions {
  ApiKeys api_keys;  // empty = no authentication
};

class RestGateway {
 public:
  RestGateway(Frontend& frontend, const openai::ChatEncoder& chat, Balancer& balancer, Metrics& metrics,
              RestGatewayOptions options);

  void Handle(const HttpRequest& request, std::shared_ptr<HttpExchange> exchange);

  // Metric label for a path: the known endpoints as themselves, anything else "other" (bounded series).
  static std::string EndpointLabel(const std::string& path);

 private:
  void Completions(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  void ChatCompletions(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  void Messages(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange, bool count_only);
  void Tokenize(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  void Detokenize(const HttpRequest& request, const std::shared_ptr<HttpExchange>& exchange);
  void Models(const std::shared_ptr<HttpExchange>& exchange);
  void Health(const std::shared_ptr<HttpExchange>& exchange);
  void MetricsText(const std::shared_ptr<HttpExchange>& exchange);

  Frontend& frontend_;
  const openai::ChatEncoder& chat_;
  Balancer& balancer_;
  Metrics& metrics_;
  RestGatewayOptions options_;
};

// Sends an OpenAI error response for `status` (with Retry-After for 429/503).
void RespondError(HttpExchange& exchange, const Status& status);

}  // namespace numoe::router
