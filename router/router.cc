#include "router/router.h"

#include <chrono>
#include <filesystem>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/config.h"
#include "common/log.h"
#include "common/tokenizer/tokenizer.h"
#include "router/balancer/grpc_worker_client.h"
#include "router/core/api_keys.h"
#include "router/grpc/inference_service.h"
#include "router/http/http_server.h"
#include "router/http/rest_gateway.h"
#include "router/http/tls.h"
#include "router/metrics/metrics.h"
#include "router/openai/chat.h"

namespace numoe::router {

// Declaration order is destruction order reversed: servers go first, then the balancer (which waits for
// its worker calls), then what they all borrow.
struct Router::Parts {
  RouterConfig config;
  std::unique_ptr<tokenizer::Tokenizer> tokenizer;
  Metrics metrics;
  ModelInfo model;
  std::unique_ptr<HttpServer> http;  // destroyed after the balancer: late events post to its (stopped) loop
  std::unique_ptr<Balancer> balancer;
  std::unique_ptr<Frontend> frontend;
  std::unique_ptr<openai::ChatEncoder> chat;
  std::unique_ptr<RestGateway> gateway;
  std::unique_ptr<GrpcServer> grpc;
};

StatusOr<std::unique_ptr<Router>> Router::Create(RouterConfig config) {
  auto parts = std::make_unique<Parts>();
  ASSIGN_OR_RETURN(ModelConfig mc, LoadModelConfig(config.model_dir));
  ASSIGN_OR_RETURN(parts->tokenizer, tokenizer::Tokenizer::Load(config.model_dir));
  ModelInfo& m = parts->model;
  m.id = config.served_model_name;
  if (m.id.empty()) {
    std::filesystem::path p(config.model_dir);
    m.id = (p.has_filename() ? p.filename() : p.parent_path().filename()).string();
  }
  m.vocab_size = static_cast<int32_t>(mc.vocab_size);
  m.max_context = static_cast<int32_t>(mc.max_position_embeddings > 0 ? mc.max_position_embeddings : 4096);
  if (config.max_model_len > 0) {
    if (config.max_model_len > m.max_context) {
      return absl::InvalidArgumentError(absl::StrCat("--max-model-len ", config.max_model_len,
                                                     " exceeds the model's max_position_embeddings ", m.max_context));
    }
    m.max_context = static_cast<int32_t>(config.max_model_len);
  }
  m.created = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                  .count();
  if (parts->tokenizer->special_ids().eos < 0) {
    NLOG(WARNING) << "the tokenizer has no end-of-sentence token: generation stops only at max_tokens";
  }

  std::vector<std::string> keys;
  if (!config.api_key.empty()) keys.push_back(config.api_key);
  if (!config.api_key_file.empty()) {
    ASSIGN_OR_RETURN(std::vector<std::string> file_keys, LoadApiKeyFile(config.api_key_file));
    keys.insert(keys.end(), file_keys.begin(), file_keys.end());
  }
  ApiKeys api_keys(std::move(keys));
  ASSIGN_OR_RETURN(TlsPem tls, LoadTlsPem(config.tls_cert, config.tls_key));
  if (api_keys.empty() && !IsLoopbackHost(config.host)) {
    NLOG(WARNING) << "--host " << config.host
                  << " accepts connections from other machines and no API key is set: anyone who can reach this "
                     "port can use the model (set --api-key-file, --api-key or $NUMOE_API_KEY)";
  }

  parts->balancer = std::make_unique<Balancer>(config.balancer, MakeGrpcWorkerClient);
  parts->frontend =
      std::make_unique<Frontend>(*parts->tokenizer, m, *parts->balancer, parts->metrics, config.frontend);
  chat::EncoderProfile profile = openai::ChatEncoder::DetectProfile(config.model_dir);
  parts->chat = std::make_unique<openai::ChatEncoder>(*parts->tokenizer, profile);
  parts->gateway = std::make_unique<RestGateway>(*parts->frontend, *parts->chat, *parts->balancer, parts->metrics,
                                                 RestGatewayOptions{api_keys});
  HttpServerOptions ho;
  ho.host = config.host;
  ho.port = config.http_port;
  ho.threads = config.http_threads;
  ho.max_body_bytes = config.max_body_bytes;
  ho.max_header_bytes = config.max_header_bytes;
  ho.max_connections = config.max_connections;
  ho.receive_timeout_s = config.receive_timeout_s;
  ho.idle_timeout_s = config.idle_timeout_s;
  ho.tls_cert_chain_pem = tls.cert_chain;
  ho.tls_private_key_pem = tls.private_key;
  RestGateway* gateway = parts->gateway.get();
  parts->http = std::make_unique<HttpServer>(
      ho, [gateway](HttpRequest req, std::shared_ptr<HttpExchange> ex) { gateway->Handle(req, std::move(ex)); });
  if (config.grpc_port >= 0) {
    GrpcServerOptions go;
    go.host = config.host;
    go.port = config.grpc_port;
    go.api_keys = api_keys;
    go.max_message_bytes = config.max_body_bytes;
    go.max_connections = config.max_connections;
    go.handshake_timeout_s = config.receive_timeout_s;
    go.idle_timeout_s = config.idle_timeout_s;
    go.max_metadata_bytes = config.max_header_bytes;
    go.tls = tls;
    parts->grpc = std::make_unique<GrpcServer>(*parts->frontend, *parts->chat, parts->metrics, std::move(go));
  }
  parts->config = std::move(config);
  return std::unique_ptr<Router>(new Router(std::move(parts)));
}

Router::Router(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

Router::~Router() {
  if (parts_->grpc) parts_->grpc->Shutdown(0.5);
  if (parts_->http) parts_->http->Shutdown();
  parts_->grpc.reset();
  parts_->gateway.reset();
  parts_->frontend.reset();
  parts_->chat.reset();
  parts_->balancer.reset();
  parts_->http.reset();
}

Status Router::Start() {
  RETURN_IF_ERROR(parts_->http->Start());
  if (parts_->grpc) {
    RETURN_IF_ERROR(parts_->grpc->Start());
    GrpcServer* grpc = parts_->grpc.get();
    parts_->balancer->SetUpCountListener([grpc](int up) { grpc->SetServing(up > 0); });
  }
  parts_->balancer->Start();
  return absl::OkStatus();
}

int Router::http_port() const { return parts_->http->port(); }
int Router::grpc_port() const { return parts_->grpc ? parts_->grpc->port() : -1; }
const ModelInfo& Router::model() const { return parts_->model; }
Balancer& Router::balancer() { return *parts_->balancer; }

bool Router::Drain(double timeout_s) {
  parts_->http->StopAccepting();
  if (parts_->grpc) parts_->grpc->SetServing(false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    size_t busy = parts_->balancer->in_flight() + parts_->balancer->queued() + parts_->http->active_exchanges();
    if (busy == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      NLOG(WARNING) << "drain: " << busy << " requests still running after " << timeout_s << " s; stopping anyway";
      if (parts_->grpc) parts_->grpc->Shutdown(0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (parts_->grpc) parts_->grpc->Shutdown(std::max(0.0, timeout_s));
  return true;
}

}  // namespace numoe::router
