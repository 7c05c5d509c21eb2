#include "router/router_app.h"

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/process.h"

namespace numoe::router {
namespace {

Status WriteReadyFile(const std::string& path, const Router& r) {
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

int RunRouterApp(const RouterAppConfig& app) {
  const RouterConfig& config = app.router;
  auto fail = [](const Status& st) {
    std::fprintf(stderr, "numoe-router: %s\n", std::string(st.message()).c_str());
    return 1;
  };
  BlockShutdownSignals();  // before any thread starts, so only the wait below takes SIGINT/SIGTERM
  auto router = Router::Create(config);
  if (!router.ok()) return fail(router.status());
  if (Status s = (*router)->Start(); !s.ok()) return fail(s);
  // "Ready" means requests can be served: one health round first, so a worker that is up is known to be
  // up when the ready file appears (a launcher's first request must not meet "no worker is up").
  // Bounded: with every worker down the file still appears after about one health timeout.
  if (!app.ready_file.empty()) {
    Balancer& b = (*router)->balancer();
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(config.balancer.health_timeout_s + 0.5);
    while (b.up_count() == 0 && std::chrono::steady_clock::now() < deadline) {
      b.CheckHealthNow();  // returns at once for a worker whose check is already running
      if (b.up_count() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (Status s = WriteReadyFile(app.ready_file, **router); !s.ok()) return fail(s);
  NLOG(INFO) << "numoe-router ready: model '" << (*router)->model().id << "', REST http://" << config.host << ":"
             << (*router)->http_port() << "/v1, gRPC "
             << ((*router)->grpc_port() >= 0 ? absl::StrCat(config.host, ":", (*router)->grpc_port()) : "off")
             << ", " << config.balancer.workers.size() << " worker(s)";

  const int sig = WaitForShutdownSignal();
  NLOG(INFO) << "numoe-router: " << (sig == SIGTERM ? "SIGTERM" : "SIGINT") << ", draining (up to "
             << app.drain_timeout_s << " s)";
  const bool clean = (*router)->Drain(app.drain_timeout_s);
  router->reset();
  NLOG(INFO) << "numoe-router: stopped" << (clean ? "" : " (requests cut at the drain deadline)");
  return 0;
}

}  // namespace numoe::router
