#include "router/router_flags.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace numoe::router {

void AddRouterFlags(ArgParser& p, RouterAppConfig* c) {
  RouterConfig& r = c->router;
  BalancerOptions& b = r.balancer;
  p.AddString("model", "DIR", "model directory (config.json, tokenizer.json)", &r.model_dir, true);
  p.AddValue(
      "workers", "LIST", "workers as host:port,host:port,...",
      [&b](const std::string& v) -> Status {
        ASSIGN_OR_RETURN(b.workers, ParseWorkerList(v));
        return absl::OkStatus();
      },
      [&b] { return absl::StrJoin(b.workers, ","); }, /*required=*/true);
  p.AddString("host", "ADDR", "address to bind both servers to", &r.host);
  p.AddInt("port", "N", "REST port (0 = any free port)", &r.http_port, 0, 65535);
  p.AddInt("grpc-port", "N", "gRPC port (0 = any free port, -1 = no gRPC server)", &r.grpc_port, -1, 65535);
  p.AddString("served-model-name", "NAME", "model id in the API (default: the model directory's name)",
              &r.served_model_name);
  p.AddInt("max-model-len", "N", "context limit, prompt + generated tokens (default: max_position_embeddings)",
           &r.max_model_len, 0, 1 << 30);
  p.AddInt("default-max-tokens", "N", "max_tokens when a request gives none (capped by the context left)",
           &r.frontend.default_max_tokens, 1, 1 << 30);
  p.AddInt("max-queue", "N", "requests waiting for a free worker slot before new ones get 429", &b.max_queue, 0,
           1 << 20);
  p.AddInt("max-inflight-per-worker", "N", "requests sent to one worker at once (0 = 2 x its max_sequences)",
           &b.max_in_flight_per_worker, 0, 1 << 20);
  p.AddDouble("queue-timeout", "S", "seconds a request may wait in the queue before 503", &b.queue_timeout_s, 0.001,
              1e6);
  p.AddDouble("request-timeout", "S", "seconds a worker call may run (0 = no limit); then 504", &b.request_timeout_s,
              0, 1e7);
  p.AddDouble("health-interval", "S", "seconds between worker health checks (Stats)", &b.health_interval_s, 0.05,
              3600);
  p.AddDouble("health-timeout", "S", "deadline of one health check", &b.health_timeout_s, 0.05, 3600);
  p.AddInt("affinity-prefix-tokens", "N", "leading prompt tokens hashed for prefix affinity (0 = off)",
           &b.policy.prefix_tokens, 0, 1 << 20);
  p.AddString("api-key", "KEY",
              "require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (default: $NUMOE_API_KEY; /health is open)",
              &r.api_key);
  p.AddString("api-key-file", "PATH",
              "accept each key in PATH as --api-key does (one key per line; blank lines and lines starting with "
              "'#' are ignored); with --api-key too, either is accepted",
              &r.api_key_file);
  p.AddString("tls-cert", "PATH",
              "serve REST (HTTPS) and gRPC over TLS with this PEM certificate chain (needs --tls-key)", &r.tls_cert);
  p.AddString("tls-key", "PATH", "the PEM private key of --tls-cert (unencrypted)", &r.tls_key);
  p.AddInt("max-connections", "N", "open connections at once, REST and gRPC each; one more gets 503 with Retry-After (gRPC: it is reset)",
           &r.max_connections, 1, 1 << 20);
  p.AddInt("max-header-bytes", "N", "largest REST request line + headers (gRPC: request metadata); larger ones get 431 (gRPC: the call fails)", &r.max_header_bytes,
           1024, 64 << 20);
  p.AddInt("max-body-bytes", "N", "largest request body (and gRPC message); larger ones get 413",
           &r.max_body_bytes, 1024, int64_t{1} << 32);
  p.AddInt("max-prompt-tokens", "N",
           "longest prompt in tokens (0 = up to the context limit); longer ones get 400 naming the limit",
           &r.frontend.max_prompt_tokens, 0, 1 << 30);
  p.AddDouble("receive-timeout", "S",
              "seconds a client may take to send one whole request (headers and body; a new connection's TLS "
              "handshake included; gRPC: from the accept to its HTTP/2 settings); then the connection is closed",
              &r.receive_timeout_s, 0.01, 86400);
  p.AddDouble("idle-timeout", "S", "seconds a keep-alive REST connection may wait idle for its next request (gRPC: a connection without a call)",
              &r.idle_timeout_s, 0.01, 86400);
  p.AddInt("http-threads", "N", "threads serving HTTP connections", &r.http_threads, 1, 256);
  p.AddDouble("drain-timeout", "S", "on SIGTERM/SIGINT, seconds to let requests in flight finish",
              &c->drain_timeout_s, 0, 3600);
  p.AddString("ready-file", "PATH",
              "write {\"http_port\", \"grpc_port\", \"pid\"} here once listening and a worker answered its health "
              "check (or after --health-timeout + 0.5 s without one)",
              &c->ready_file);
}

std::vector<std::string> RouterArgv(const RouterAppConfig& c) { return ArgvOf(c, AddRouterFlags); }

StatusOr<std::vector<std::string>> ParseWorkerList(const std::string& text) {
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::string entry(absl::StripAsciiWhitespace(part));
    size_t colon = entry.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(entry.substr(colon + 1), &port) || port <= 0 ||
        port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat("--workers: '", entry, "' is not host:port"));
    }
    out.push_back(entry);
  }
  if (out.empty()) return absl::InvalidArgumentError("--workers: give at least one host:port");
  return out;
}


}  // namespace numoe::router
