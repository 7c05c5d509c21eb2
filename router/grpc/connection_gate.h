// The gRPC listener's bound on open connections. gRPC 1.51 (Debian 12) has no such bound (its
// GRPC_ARG_MAX_ALLOWED_INCOMING_CONNECTIONS came later), so the router accepts gRPC connections itself: at
// most max_connections are open at once, one more is reset at once (a gRPC client sees UNAVAILABLE and
// retries with its backoff), and the bytes of the others are relayed unchanged to the gRPC server, which
// listens on a unix socket in a directory only this user can enter. TLS, when on, passes through: gRPC
// terminates it, and gRPC's own limits (handshake deadline, idle connections, streams, metadata size) apply
// to each relayed connection as to a direct one.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"

namespace numoe::router {

struct ConnectionGateOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0 = any free port
  int max_connections = 1024;
  std::string backend_unix_path;  // where the gRPC server listens
};

class ConnectionGate {
 public:
  explicit ConnectionGate(ConnectionGateOptions options);
  ~ConnectionGate();  // Stop()
  ConnectionGate(const ConnectionGate&) = delete;
  ConnectionGate& operator=(const ConnectionGate&) = delete;

  // Listens on host:port and starts relaying; an error names the address.
  Status Start();
  int port() const;
  // Connections open now (relayed; those being refused not included).
  int open_connections() const;
  // Stops accepting and closes every connection.
  void Stop();

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace numoe::router
