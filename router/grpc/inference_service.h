// numoe.v1.Inference (proto/numoe/v1/inference.proto) on the gRPC callback API, plus the standard
// grpc.health.v1 service (SERVING while at least one worker is up).
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
