// WorkerClient over gRPC (proto/numoe/v1/worker.proto), on the callback API: no thread per request.
#pragma once

#include <memory>
#include <string>

#include "router/balancer/worker_client.h"

namespace numoe::router {

// One channel per worker. Reconnect backoff is capped at 1 s so a restarted worker is reachable by the next
// health check; keepalive pings notice a peer that vanished without closing its sockets.
std::unique_ptr<WorkerClient> MakeGrpcWorkerClient(const std::string& address);

}  // namespace numoe::router
