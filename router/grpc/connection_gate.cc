// Boost 1.74 + GCC 12 + C++20: Asio's awaitable.hpp uses std::exchange without including <utility>
// (docs/toolchain-notes.md §2.5), so it comes first.
#include <utility>

#include "router/grpc/connection_gate.h"

#include <array>
#include <atomic>
#include <optional>
#include <thread>

#include <boost/asio.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace numoe::router {

namespace net = boost::asio;
using tcp = net::ip::tcp;
using unix_socket = net::local::stream_protocol;
using net::awaitable;
using net::redirect_error;
using net::use_awaitable;
using error_code = boost::system::error_code;

namespace {

// One relayed connection: the client's socket and the one to the gRPC server. Counted while it lives.
struct Pair {
  Pair(tcp::socket c, unix_socket::socket b, std::atomic<int>* n) : client(std::move(c)), backend(std::move(b)), open(n) {}
  ~Pair() { open->fetch_sub(1); }
  void Close() {
    error_code ec;
    client.shutdown(tcp::socket::shutdown_both, ec);
    client.close(ec);
    backend.shutdown(unix_socket::socket::shutdown_both, ec);
    backend.close(ec);
  }
  tcp::socket client;
  unix_socket::socket backend;
  std::atomic<int>* open;
};

// Copies bytes from `from` to `to` until either side ends, then closes both (HTTP/2 has no half-close).
template <class From, class To>
awaitable<void> Pump(std::shared_ptr<Pair> pair, From& from, To& to) {
  std::array<char, 16384> buf;
  for (;;) {
    error_code ec;
    const size_t n = co_await from.async_read_some(net::buffer(buf), redirect_error(use_awaitable, ec));
    if (ec || n == 0) break;
    co_await net::async_write(to, net::buffer(buf.data(), n), redirect_error(use_awaitable, ec));
    if (ec) break;
  }
  pair->Close();
}

}  // namespace

struct ConnectionGate::Impl {
  ConnectionGateOptions options;
  std::atomic<int> open{0};
  // Reset by Stop(): destroying the io_context destroys the coroutines still suspended, and their sockets.
  std::optional<net::io_context> ioc{std::in_place, 1};
  std::optional<tcp::acceptor> acceptor{std::in_place, *ioc};
  std::thread thread;
  int port = 0;
  bool stopped = false;

  // Connects to the gRPC server, then relays both ways; counted in `open` from the accept on.
  awaitable<void> Relay(tcp::socket client) {
    unix_socket::socket backend(*ioc);
    error_code ec;
    co_await backend.async_connect(unix_socket::endpoint(options.backend_unix_path), redirect_error(use_awaitable, ec));
    if (ec) {
      NLOG(WARNING) << "gRPC: cannot reach the gRPC server at " << options.backend_unix_path << ": " << ec.message();
      client.close(ec);
      open.fetch_sub(1);
      co_return;
    }
    auto pair = std::make_shared<Pair>(std::move(client), std::move(backend), &open);
    net::co_spawn(*ioc, Pump(pair, pair->client, pair->backend), net::detached);
    net::co_spawn(*ioc, Pump(pair, pair->backend, pair->client), net::detached);
  }

  awaitable<void> Accept() {
    for (;;) {
      error_code ec;
      tcp::socket socket = co_await acceptor->async_accept(redirect_error(use_awaitable, ec));
      if (ec == net::error::operation_aborted || !acceptor->is_open()) co_return;
      if (ec) {
        NLOG(WARNING) << "gRPC: accept failed: " << ec.message();
        net::steady_timer t(*ioc, std::chrono::milliseconds(100));  // e.g. out of file descriptors
        co_await t.async_wait(redirect_error(use_awaitable, ec));
        continue;
      }
      if (open.load() >= options.max_connections) {
        // Reset, not a polite close: nothing of the refused connection lingers.
        socket.set_option(net::socket_base::linger(true, 0), ec);
        socket.close(ec);
        continue;
      }
      socket.set_option(tcp::no_delay(true), ec);  // as gRPC's own sockets: small frames go out at once
      open.fetch_add(1);
      net::co_spawn(*ioc, Relay(std::move(socket)), net::detached);
    }
  }
};

ConnectionGate::ConnectionGate(ConnectionGateOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
}

ConnectionGate::~ConnectionGate() { Stop(); }

Status ConnectionGate::Start() {
  const std::string where = absl::StrCat(impl_->options.host, ":", impl_->options.port);
  error_code ec;
  const net::ip::address addr = net::ip::make_address(impl_->options.host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("gRPC: --host ", impl_->options.host, ": ", ec.message()));
  const tcp::endpoint endpoint(addr, static_cast<unsigned short>(impl_->options.port));
  impl_->acceptor->open(endpoint.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(endpoint, ec);
  if (!ec) impl_->acceptor->listen(net::socket_base::max_listen_connections, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("gRPC: cannot listen on ", where, ": ", ec.message()));
  impl_->port = impl_->acceptor->local_endpoint().port();
  net::co_spawn(*impl_->ioc, impl_->Accept(), net::detached);
  impl_->thread = std::thread([this] { impl_->ioc->run(); });
  return absl::OkStatus();
}

int ConnectionGate::port() const { return impl_->port; }

int ConnectionGate::open_connections() const { return impl_->open.load(); }

void ConnectionGate::Stop() {
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->ioc->stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  impl_->acceptor.reset();
  impl_->ioc.reset();
}

}  // namespace numoe::router
