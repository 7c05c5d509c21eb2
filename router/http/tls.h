// The router's TLS certificate and key (--tls-cert, --tls-key), read and checked once at start; the REST
// server (http_server.h, Boost.Asio SSL) and the gRPC server (grpc::SslServerCredentials) both take the
// PEM text from here.
#pragma once

#include <string>

#include "common/status.h"

namespace numoe::router {

struct TlsPem {
  std::string cert_chain;   // PEM: the server certificate first, then any intermediates
  std::string private_key;  // PEM: the certificate's private key (unencrypted)

  bool enabled() const { return !cert_chain.empty(); }
  bool operator==(const TlsPem&) const = default;
};

// Reads both files and checks them with OpenSSL: each parses as PEM, the key matches the certificate.
// Both paths empty = TLS off (an empty TlsPem). Errors name the flag and the file ("--tls-key k.pem: ...").
StatusOr<TlsPem> LoadTlsPem(const std::string& cert_path, const std::string& key_path);

}  // namespace numoe::router
