// numoe-router as a program: build the Router, start it, write the ready file once a worker answered
// (or after one health timeout), serve until SIGINT/SIGTERM, then drain. router/router_flags.h turns the
// command line into a RouterAppConfig and back.
#pragma once

#include <string>

#include "router/router.h"

namespace numoe::router {

struct RouterAppConfig {
  RouterConfig router;
  // Written as {"http_port", "grpc_port", "pid"} once listening and a worker answered its health check
  // (or after health_timeout_s + 0.5 s without one); "" = none. How launchers see readiness.
  std::string ready_file;
  double drain_timeout_s = 30;  // on SIGTERM/SIGINT, seconds to let requests in flight finish

  bool operator==(const RouterAppConfig&) const = default;
};

// Runs until SIGINT/SIGTERM (exit code 0) or a start-up error (1, printed).
int RunRouterApp(const RouterAppConfig& config);

}  // namespace numoe::router
