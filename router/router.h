// numoe-router assembled: tokenizer + model facts, balancer, frontend, REST gateway + HTTP server, gRPC
// server, metrics. router_app.h runs one as the numoe-router process; router_flags.h fills its config.
//
// Lifetime: Create() loads the model facts; Start() binds both ports and starts health checks (workers start
// down and come up as they answer); Drain() stops accepting new requests and waits for those in flight;
// the destructor stops everything.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "router/balancer/balancer.h"
#include "router/core/frontend.h"

namespace numoe::router {

struct RouterConfig {
  std::string model_dir;          // config.json + tokenizer.json
  std::string served_model_name;  // "" = the model directory's name
  int64_t max_model_len = 0;      // 0 = max_position_embeddings from config.json
  std::string host = "127.0.0.1";
  int http_port = 8000;  // 0 = any free port
  int grpc_port = 8001;  // 0 = any free port, -1 = no gRPC server
  int http_threads = 2;
  // Limits of the REST server (router/http/http_server.h has what each does); max_body_bytes also caps a
  // gRPC message.
  size_t max_body_bytes = 8u << 20;
  size_t max_header_bytes = 64u << 10;
  int max_connections = 1024;
  double receive_timeout_s = 30;
  double idle_timeout_s = 120;
  // API keys (router/core/api_keys.h): this one and those of the file; none = no authentication.
  std::string api_key;
  std::string api_key_file;
  // TLS for both servers (router/http/tls.h): PEM files, both or neither.
  std::string tls_cert;
  std::string tls_key;
  FrontendOptions frontend;
  BalancerOptions balancer;  // .workers required

  bool operator==(const RouterConfig&) const = default;
};

class Router {
 public:
  static StatusOr<std::unique_ptr<Router>> Create(RouterConfig config);
  ~Router();

  Status Start();
  int http_port() const;
  int grpc_port() const;  // -1 when disabled
  const ModelInfo& model() const;
  Balancer& balancer();

  // Stops taking requests (new connections are refused, gRPC answers UNAVAILABLE via health) and waits up to
  // timeout_s for requests in flight to finish. Returns whether everything finished in time.
  bool Drain(double timeout_s);

  struct Parts;

 private:
  explicit Router(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace numoe::router
