// The HTTP/1.1 server under the REST gateway (Boost.Beast, C++20 coroutines; Beast stays inside
// http_server.cc, the only TU that includes it, because it is slow to compile).
//
// Each connection is one coroutine on its own strand: (with TLS, the handshake first) read a request (headers
// first, so an oversized Content-Length is answered 413 before any body byte is read, and "Expect:
// 100-continue" is honoured),
// hand it to the handler with an HttpExchange, then write whatever the exchange produces (one response or
// a chunked text/event-stream), and loop for keep-alive. The exchange is fed from any thread; writes happen
// on the connection's strand. A client that disconnects is noticed by a failed write or, while idle,
// by a socket peek every 250 ms, and the exchange's OnClientGone callback runs.
//
// Limits, so that clients cannot hold the server's memory or connections: at most max_connections open
// connections (one more is answered 503 with Retry-After and closed), request headers up to
// max_header_bytes (else 431), bodies up to max_body_bytes (else 413), and receive_timeout_s for one whole
// request, from its first byte (a new connection's: from the accept, TLS handshake included) to its last:
// a client that sends one byte a second is cut off then (the connection is closed). A keep-alive
// connection may sit idle between requests for idle_timeout_s.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "common/status.h"
#include "router/http/exchange.h"

namespace numoe::router {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = any free port (see port())
  int threads = 2;
  size_t max_body_bytes = 8u << 20;     // larger bodies get 413
  size_t max_header_bytes = 64u << 10;  // request line + headers; larger get 431
  int max_connections = 1024;           // open connections; one more gets 503 + Retry-After
  double receive_timeout_s = 30;        // one request, first byte to last; then the connection is closed
  double idle_timeout_s = 120;          // keep-alive connections idle this long are closed
  // PEM text (router/http/tls.h); both set = HTTPS on the same port.
  std::string tls_cert_chain_pem;
  std::string tls_private_key_pem;
};

class HttpServer {
 public:
  using Handler = std::function<void(HttpRequest request, std::shared_ptr<HttpExchange> exchange)>;

  HttpServer(HttpServerOptions options, Handler handler);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds, listens and starts the threads. Errors name the address ("127.0.0.1:8000: Address already in use").
  Status Start();
  // The bound port (after Start).
  int port() const;
  // Stops accepting connections; exchanges in progress continue.
  void StopAccepting();
  // Stops everything and joins the threads (open connections are dropped).
  void Shutdown();
  // Exchanges whose response is not complete yet.
  size_t active_exchanges() const;
  // Open connections, counted against max_connections (those being refused not included).
  size_t open_connections() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace numoe::router
