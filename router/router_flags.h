// numoe-router's command line, defined once: AddRouterFlags registers every flag onto a RouterAppConfig,
// RouterArgv writes a RouterAppConfig back as the argv that parses to it (used by deploy/launch.h for
// `numoe serve` and `numoe plan --emit`).
#pragma once

#include <string>
#include <vector>

#include "common/args.h"
#include "common/status.h"
#include "router/router_app.h"

namespace numoe::router {

// Binds every numoe-router flag to a field of `c`; the fields' current values are the defaults (main sets
// router.api_key from $NUMOE_API_KEY first).
void AddRouterFlags(ArgParser& p, RouterAppConfig* c);

// The flags of the fields of `c` that differ from a default RouterAppConfig (the binary name not included).
std::vector<std::string> RouterArgv(const RouterAppConfig& c);

// "host:port,host:port" -> list; errors name the bad entry.
StatusOr<std::vector<std::string>> ParseWorkerList(const std::string& text);

}  // namespace numoe::router
