// The OpenAI-compatible REST API on top of the Frontend:
//   POST /v1/completions        prompt as text, token ids, or a list of either (one choice each)
//   POST /v1/chat/completions   DeepSeek V4 chat encoding, reasoning_content / content / tool_calls
//   GET  /v1/models             the served model
//   GET  /health                200 {"status":"ok",...} when at least one worker is up, else 503
//   GET  /metrics               Prometheus text (metrics.h)
// "stream": true answers with server-sent events in OpenAI's chunk shapes, ending with "data: [DONE]";
// a failure after the stream started is sent as a {"error": {...}} event, then [DONE].
// A prompt longer than the context is 400 with param "prompt" (or "messages"); a body over
// max_body_bytes is 413 (checked by the HTTP server before the body is read).
// With api_key set, every endpoint except /health needs "Authorization: Bearer <key>" (else 401).
//
// Thread-safety: Handle() may be called from any number of threads at once.
#pragma once

#include <memory>
#include <string>

#include "router/balancer/balancer.h"
#include "router/core/frontend.h"
#include "router/http/exchange.h"
#include "router/metrics/metrics.h"

namespace numoe::router {

namespace openai {
class ChatEncoder;
}

struct RestGatewayOptions {
  std::string api_key;  // "" = no authentication
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
