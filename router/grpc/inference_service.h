// numoe.v1.Inference (proto/numoe/v1/inference.proto) on the gRPC callback API, plus the standard
// grpc.health.v1 service (SERVING while at least one worker is up).
//
// The listener is a ConnectionGate (router/grpc/connection_gate.h) in front of the gRPC server, which
// listens on a private unix socket.
//
// Status mapping: bad fields -> INVALID_ARGUMENT (the message starts with the field name), unknown model
// -> NOT_FOUND, queue full -> RESOURCE_EXHAUSTED, no worker up / worker failed -> UNAVAILABLE (a stream
// that already sent tokens ends with UNAVAILABLE too).
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "router/core/api_keys.h"
#include "router/core/frontend.h"
#include "router/http/tls.h"
#include "router/metrics/metrics.h"

namespace numoe::router {

namespace openai {
class ChatEncoder;
}

struct GrpcServerOptions {
  std::string host = "127.0.0.1";
  int port = 8001;  // 0 = any free port
  ApiKeys api_keys;  // empty = none; else metadata "authorization: Bearer <key>" is required
  size_t max_message_bytes = 8u << 20;  // largest request message; larger ones get RESOURCE_EXHAUSTED
  TlsPem tls;                           // enabled = TLS (grpc::SslServerCredentials) on the same port
  // Connection limits (README "Limits, API keys and TLS"): open connections (router/grpc/connection_gate.h;
  // one more is reset), the time from the accept to the client's HTTP/2 settings (the TLS handshake
  // included; then the connection is closed), connections without a call for this long get GOAWAY, calls at
  // once on one connection (more wait in the client), request metadata (larger: the call fails).
  int max_connections = 1024;
  double handshake_timeout_s = 30;
  double idle_timeout_s = 120;
  int max_concurrent_streams = 100;
  size_t max_metadata_bytes = 64u << 10;
};

class GrpcServer {
 public:
  GrpcServer(Frontend& frontend, const openai::ChatEncoder& chat, Metrics& metrics, GrpcServerOptions options);
  ~GrpcServer();
  Status Start();
  int port() const;
  // Health status of "" and "numoe.v1.Inference".
  void SetServing(bool serving);
  // Stops accepting calls, waits up to `deadline_s` for calls in progress, then cancels them.
  void Shutdown(double deadline_s);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace numoe::router
