// numoe-router: the front door (gRPC API + OpenAI-compatible REST gateway, tokenizer, load balancing).
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/args.h"
#include "common/log.h"
#include "router/router.h"

namespace {

// Blocks SIGINT/SIGTERM in every thread (call before any thread starts) so main can sigwait for them.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

numoe::Status WriteReadyFile(const std::string& path, const numoe::router::Router& r) {
  if (path.empty()) return absl::OkStatus();
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << "{\"http_port\": " << r.http_port() << ", \"grpc_port\": " << r.grpc_port() << ", \"pid\": " << getpid()
      << "}\n";
    if (!f) return absl::InternalError(absl::StrCat("--ready-file: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("--ready-file: cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  using numoe::router::RouterConfig;
  RouterConfig config;
  std::string workers, ready_file;
  int64_t http_port = config.http_port, grpc_port = config.grpc_port, http_threads = config.http_threads;
  int64_t max_body = static_cast<int64_t>(config.max_body_bytes), max_model_len = 0;
  int64_t default_max_tokens = config.frontend.default_max_tokens, max_queue = config.balancer.max_queue;
  int64_t max_in_flight = 0, affinity_tokens = config.balancer.policy.prefix_tokens;
  double queue_timeout = config.balancer.queue_timeout_s, request_timeout = 0;
  double health_interval = config.balancer.health_interval_s, health_timeout = config.balancer.health_timeout_s;
  double drain_timeout = 30;
  if (const char* key = std::getenv("NUMOE_API_KEY")) config.api_key = key;

  numoe::ArgParser p("numoe-router",
                     "The front door: gRPC API (numoe.v1.Inference + grpc.health.v1) and an OpenAI-compatible REST\n"
                     "gateway (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) that tokenizes,\n"
                     "applies the DeepSeek V4 chat encoding and balances requests over numoe-worker processes.");
  p.AddString("model", "DIR", "model directory (config.json, tokenizer.json)", &config.model_dir, true);
  p.AddString("workers", "LIST", "workers as host:port,host:port,...", &workers, true);
  p.AddString("host", "ADDR", "address to bind both servers to", &config.host);
  p.AddInt("port", "N", "REST port (0 = any free port)", &http_port, 0, 65535);
  p.AddInt("grpc-port", "N", "gRPC port (0 = any free port, -1 = no gRPC server)", &grpc_port, -1, 65535);
  p.AddString("served-model-name", "NAME", "model id in the API (default: the model directory's name)",
              &config.served_model_name);
  p.AddInt("max-model-len", "N", "context limit, prompt + generated tokens (default: max_position_embeddings)",
           &max_model_len, 0, 1 << 30);
  p.AddInt("default-max-tokens", "N", "max_tokens when a request gives none (capped by the context left)",
           &default_max_tokens, 1, 1 << 30);
  p.AddInt("max-queue", "N", "requests waiting for a free worker slot before new ones get 429", &max_queue, 0,
           1 << 20);
  p.AddInt("max-inflight-per-worker", "N", "requests sent to one worker at once (0 = 2 x its max_sequences)",
           &max_in_flight, 0, 1 << 20);
  p.AddDouble("queue-timeout", "S", "seconds a request may wait in the queue before 503", &queue_timeout, 0.001, 1e6);
  p.AddDouble("request-timeout", "S", "seconds a worker call may run (0 = no limit); then 504", &request_timeout, 0,
              1e7);
  p.AddDouble("health-interval", "S", "seconds between worker health checks (Stats)", &health_interval, 0.05, 3600);
  p.AddDouble("health-timeout", "S", "deadline of one health check", &health_timeout, 0.05, 3600);
  p.AddInt("affinity-prefix-tokens", "N", "leading prompt tokens hashed for prefix affinity (0 = off)",
           &affinity_tokens, 0, 1 << 20);
  p.AddString("api-key", "KEY", "require 'Authorization: Bearer KEY' (default: $NUMOE_API_KEY; /health is open)",
              &config.api_key);
  p.AddInt("max-body-bytes", "N", "largest request body; larger ones get 413", &max_body, 1024, int64_t{1} << 32);
  p.AddInt("http-threads", "N", "threads serving HTTP connections", &http_threads, 1, 256);
  p.AddDouble("drain-timeout", "S", "on SIGTERM/SIGINT, seconds to let requests in flight finish", &drain_timeout, 0,
              3600);
  p.AddString("ready-file", "PATH", "write {\"http_port\", \"grpc_port\", \"pid\"} here once listening and a worker answered its health check (or after --health-timeout + 0.5 s without one)",
              &ready_file);
  p.AddEpilog(
      "\nErrors use OpenAI's JSON: 400 bad field (\"param\" names it; also a prompt past the context), 401 API key,\n"
      "404 unknown model/path, 413 body too large, 429 queue full (Retry-After), 503 no worker up, 504 timeout.\n"
      "Example: numoe-router --model tests/data/tiny-v4 --workers 127.0.0.1:9101,127.0.0.1:9102\n");
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;

  auto list = numoe::router::ParseWorkerList(workers);
  if (!list.ok()) {
    std::fprintf(stderr, "numoe-router: %s\n", std::string(list.status().message()).c_str());
    return 2;
  }
  config.http_port = static_cast<int>(http_port);
  config.grpc_port = static_cast<int>(grpc_port);
  config.http_threads = static_cast<int>(http_threads);
  config.max_body_bytes = static_cast<size_t>(max_body);
  config.max_model_len = max_model_len;
  config.frontend.default_max_tokens = static_cast<int32_t>(default_max_tokens);
  config.balancer.workers = *list;
  config.balancer.max_queue = static_cast<int>(max_queue);
  config.balancer.max_in_flight_per_worker = static_cast<int>(max_in_flight);
  config.balancer.queue_timeout_s = queue_timeout;
  config.balancer.request_timeout_s = request_timeout;
  config.balancer.health_interval_s = health_interval;
  config.balancer.health_timeout_s = health_timeout;
  config.balancer.policy.prefix_tokens = static_cast<int>(affinity_tokens);

  sigset_t stop_signals = BlockStopSignals();
  auto router = numoe::router::Router::Create(config);
  if (!router.ok()) {
    std::fprintf(stderr, "numoe-router: %s\n", std::string(router.status().message()).c_str());
    return 1;
  }
  if (numoe::Status s = (*router)->Start(); !s.ok()) {
    std::fprintf(stderr, "numoe-router: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  // "Ready" means requests can be served: one health round first, so a worker that is up is known to be
  // up when the ready file appears (a launcher's first request must not meet "no worker is up").
  // Bounded: with every worker down the file still appears after about one health timeout.
  if (!ready_file.empty()) {
    numoe::router::Balancer& b = (*router)->balancer();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(health_timeout + 0.5);
    while (b.up_count() == 0 && std::chrono::steady_clock::now() < deadline) {
      b.CheckHealthNow();  // returns at once for a worker whose check is already running
      if (b.up_count() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (numoe::Status s = WriteReadyFile(ready_file, **router); !s.ok()) {
    std::fprintf(stderr, "numoe-router: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  NLOG(INFO) << "numoe-router ready: model '" << (*router)->model().id << "', REST http://" << config.host << ":"
             << (*router)->http_port() << "/v1, gRPC "
             << ((*router)->grpc_port() >= 0 ? absl::StrCat(config.host, ":", (*router)->grpc_port()) : "off")
             << ", " << list->size() << " worker(s)";

  int sig = 0;
  sigwait(&stop_signals, &sig);
  NLOG(INFO) << "numoe-router: " << (sig == SIGTERM ? "SIGTERM" : "SIGINT") << ", draining (up to " << drain_timeout
             << " s)";
  bool clean = (*router)->Drain(drain_timeout);
  router->reset();
  NLOG(INFO) << "numoe-router: stopped" << (clean ? "" : " (requests cut at the drain deadline)");
  return 0;
}
