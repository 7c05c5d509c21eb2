// Boost 1.74 + GCC 12 + C++20: Asio's awaitable.hpp uses std::exchange without including <utility>
// (docs/toolchain-notes.md §2.5), so it comes first.
#include <utility>

#include "router/http/http_server.h"

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <variant>
#include <vector>

#include <boost/asio.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace numoe::router {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
namespace ssl = boost::asio::ssl;
using tcp = net::ip::tcp;
using net::awaitable;
using net::redirect_error;
using net::use_awaitable;

namespace {

// One exchange's output, produced on any thread and written by the connection's coroutine.
class BeastExchange : public HttpExchange, public std::enable_shared_from_this<BeastExchange> {
 public:
  struct Whole {
    int status;
    std::string content_type;
    std::string body;
    HttpHeaders headers;
  };
  struct Event {
    std::string data;
  };
  struct End {};
  using Op = std::variant<Whole, Event, End>;

  BeastExchange(net::any_io_executor strand, std::atomic<size_t>* active)
      : strand_(strand), timer_(strand), active_(active) {
    active_->fetch_add(1);
  }
  ~BeastExchange() override {
    if (!completed_flag_.exchange(true)) active_->fetch_sub(1);
  }

  void Respond(int status, const std::string& content_type, std::string body, HttpHeaders headers) override {
    Push(Whole{status, content_type, std::move(body), std::move(headers)}, /*completes=*/true);
  }
  void SendEvent(std::string event) override { Push(Event{std::move(event)}, false); }
  void EndEvents() override { Push(End{}, true); }

  void OnClientGone(std::function<void()> fn) override {
    bool gone_now = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_) {
        gone_now = true;
      } else if (!closed_) {
        gone_fn_ = std::move(fn);
      }
    }
    if (gone_now && fn) fn();
  }

  // Writes the exchange's output; returns whether the connection may serve another request.
  template <class Stream>
  awaitable<bool> Drive(Stream& stream, unsigned version, bool keep_alive, bool head) {
    bool header_sent = false;
    http::response<http::empty_body> sse_head;
    for (;;) {
      std::deque<Op> ops;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ops.swap(ops_);
      }
      if (ops.empty()) {
        timer_.expires_after(std::chrono::milliseconds(250));
        beast::error_code ec;
        co_await timer_.async_wait(redirect_error(use_awaitable, ec));
        if (ec != net::error::operation_aborted && PeerClosed(beast::get_lowest_layer(stream))) {
          ClientGone();
          co_return false;
        }
        continue;
      }
      for (Op& op : ops) {
        beast::error_code ec;
        if (auto* w = std::get_if<Whole>(&op)) {
          http::response<http::string_body> res{static_cast<http::status>(w->status), version};
          res.set(http::field::server, "numoe-router");
          res.set(http::field::content_type, w->content_type);
          for (auto& [k, v] : w->headers) res.set(k, v);
          res.keep_alive(keep_alive);
          res.body() = std::move(w->body);
          res.prepare_payload();
          if (head) res.body().clear();
          co_await http::async_write(stream, res, redirect_error(use_awaitable, ec));
          MarkCompleted();
          if (ec) {
            ClientGone();
            co_return false;
          }
          co_return keep_alive && !res.need_eof();
        }
        if (auto* e = std::get_if<Event>(&op)) {
          if (!header_sent) {
            sse_head = http::response<http::empty_body>{http::status::ok, version};
            sse_head.set(http::field::server, "numoe-router");
            sse_head.set(http::field::content_type, "text/event-stream");
            sse_head.set(http::field::cache_control, "no-cache");
            sse_head.set("X-Accel-Buffering", "no");
            sse_head.keep_alive(keep_alive);
            sse_head.chunked(true);
            http::response_serializer<http::empty_body> sr{sse_head};
            co_await http::async_write_header(stream, sr, redirect_error(use_awaitable, ec));
            header_sent = true;
          }
          if (!ec) {
            co_await net::async_write(stream, http::make_chunk(net::buffer(e->data)),
                                      redirect_error(use_awaitable, ec));
          }
          if (ec) {
            MarkCompleted();
            ClientGone();
            co_return false;
          }
          continue;
        }
        // End of the event stream.
        if (header_sent) co_await net::async_write(stream, http::make_chunk_last(), redirect_error(use_awaitable, ec));
        MarkCompleted();
        if (ec) {
          ClientGone();
          co_return false;
        }
        co_return keep_alive;
      }
    }
  }

 private:
  void Push(Op op, bool completes) {
    // The client-gone callback usually owns the request (which owns this exchange): once the response is
    // complete it is dropped, outside the lock, so the pair can be freed.
    std::function<void()> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_ || gone_) return;
      if (completes) {
        closed_ = true;
        drop = std::move(gone_fn_);
        gone_fn_ = nullptr;
      }
      ops_.push_back(std::move(op));
    }
    // Wake the coroutine: the timer may only be touched on the strand.
    net::post(strand_, [self = shared_from_this()] { self->timer_.cancel(); });
  }

  void MarkCompleted() {
    if (!completed_flag_.exchange(true)) active_->fetch_sub(1);
  }

  void ClientGone() {
    std::function<void()> fn;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_) return;
      gone_ = true;
      fn = std::move(gone_fn_);
    }
    MarkCompleted();
    if (fn) fn();
  }

  // The peer closed (or reset) its side: a non-blocking peek reads 0 bytes or fails with a real error.
  static bool PeerClosed(beast::tcp_stream& stream) {
    char c;
    ssize_t n = ::recv(stream.socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
    return false;
  }

  net::any_io_executor strand_;
  net::steady_timer timer_;
  std::atomic<size_t>* active_;
  std::atomic<bool> completed_flag_{false};

  std::mutex mu_;
  std::deque<Op> ops_;
  bool closed_ = false;  // the final op was pushed
  bool gone_ = false;
  std::function<void()> gone_fn_;
};

std::string ErrorBody(const std::string& message, const std::string& code) {
  // Same shape as openai::ErrorJson; written by hand to keep JSON out of this TU.
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    escaped += c;
  }
  return absl::StrCat(R"({"error":{"message":")", escaped, R"(","type":"invalid_request_error","param":null,"code":")",
                      code, R"("}})");
}

}  // namespace

struct HttpServer::Impl {
  // Connections being answered 503 at once beyond max_connections; past this they are closed unanswered.
  static constexpr int kMaxRefusing = 64;

  HttpServerOptions options;
  Handler handler;
  // Before the io_context: connections still pending when it is destroyed use these as they unwind.
  std::optional<ssl::context> tls;  // set = HTTPS
  std::atomic<size_t> active{0};
  std::atomic<int> connections{0};
  std::atomic<int> refusing{0};
  net::io_context ioc;
  tcp::acceptor acceptor{ioc};
  std::vector<std::thread> threads;
  int port = 0;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;

  // Counts a connection for its lifetime.
  struct Counted {
    std::atomic<int>* n;
    explicit Counted(std::atomic<int>* c) : n(c) {}
    ~Counted() { n->fetch_sub(1); }
  };

  std::chrono::milliseconds Ms(double seconds) const {
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  }

  Status SetUpTls() {
    if (options.tls_cert_chain_pem.empty() && options.tls_private_key_pem.empty()) return absl::OkStatus();
    tls.emplace(ssl::context::tls_server);
    beast::error_code ec;
    tls->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 | ssl::context::no_sslv3 |
                         ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 | ssl::context::single_dh_use,
                     ec);
    if (!ec) tls->use_certificate_chain(net::buffer(options.tls_cert_chain_pem), ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("--tls-cert: ", ec.message()));
    tls->use_private_key(net::buffer(options.tls_private_key_pem), ssl::context::pem, ec);
    if (ec) return absl::InvalidArgumentError(absl::StrCat("--tls-key: ", ec.message()));
    return absl::OkStatus();
  }

  awaitable<void> Accept() {
    for (;;) {
      beast::error_code ec;
      tcp::socket socket = co_await acceptor.async_accept(net::make_strand(ioc), redirect_error(use_awaitable, ec));
      if (ec == net::error::operation_aborted || !acceptor.is_open()) co_return;
      if (ec) {
        NLOG(WARNING) << "http: accept failed: " << ec.message();
        net::steady_timer t(ioc, std::chrono::milliseconds(100));  // e.g. out of file descriptors
        co_await t.async_wait(redirect_error(use_awaitable, ec));
        continue;
      }
      bool over = false;
      if (connections.fetch_add(1) >= options.max_connections) {
        connections.fetch_sub(1);
        over = true;
        if (refusing.fetch_add(1) >= kMaxRefusing) {  // a flood: refuse without a word
          refusing.fetch_sub(1);
          socket.close(ec);
          continue;
        }
      }
      auto executor = socket.get_executor();
      net::co_spawn(executor, Session(std::move(socket), over), net::detached);
    }
  }

  template <class Stream>
  awaitable<void> WriteSimple(Stream& stream, http::status status, unsigned version, const std::string& body,
                              const HttpHeaders& headers = {}) {
    http::response<http::string_body> res{status, version};
    res.set(http::field::server, "numoe-router");
    res.set(http::field::content_type, "application/json");
    for (const auto& [k, v] : headers) res.set(k, v);
    res.keep_alive(false);
    res.body() = body;
    res.prepare_payload();
    beast::error_code ec;
    co_await http::async_write(stream, res, redirect_error(use_awaitable, ec));
  }

  // One accepted connection: the TLS handshake when on, then the requests; `over` = beyond max_connections.
  awaitable<void> Session(tcp::socket socket, bool over) {
    std::optional<Counted> counted;
    counted.emplace(over ? &refusing : &connections);
    beast::tcp_stream tcp_stream(std::move(socket));
    // A new connection's first request (the handshake included) must arrive within the receive deadline.
    tcp_stream.expires_after(Ms(over ? std::min(options.receive_timeout_s, 2.0) : options.receive_timeout_s));
    try {
      if (!tls) {
        co_await Serve(tcp_stream, over);
        co_await LingeringClose(tcp_stream);
        co_return;
      }
      beast::ssl_stream<beast::tcp_stream> stream(std::move(tcp_stream), *tls);
      beast::error_code ec;
      co_await stream.async_handshake(ssl::stream_base::server, redirect_error(use_awaitable, ec));
      if (ec) co_return;  // not TLS, a bad certificate for the client, or too slow: nothing to answer
      co_await Serve(stream, over);
      // close_notify, waiting a moment for the client's.
      beast::get_lowest_layer(stream).expires_after(std::chrono::seconds(1));
      co_await stream.async_shutdown(redirect_error(use_awaitable, ec));
    } catch (const std::exception& e) {
      NLOG(WARNING) << "http: connection dropped: " << e.what();
    }
  }

  // Closes our side, then reads (and drops) what the client still sends for a moment: closing a socket
  // with unread bytes resets the connection, and the client could lose an error answer written just before.
  awaitable<void> LingeringClose(beast::tcp_stream& stream) {
    beast::error_code ec;
    if (!stream.socket().is_open()) co_return;  // closed at a deadline
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) co_return;
    stream.expires_after(std::chrono::milliseconds(500));
    char sink[4096];
    for (size_t total = 0; total < (256u << 10);) {
      size_t n = co_await stream.async_read_some(net::buffer(sink), redirect_error(use_awaitable, ec));
      if (ec) break;
      total += n;
    }
  }

  // Answers 503 to a connection beyond max_connections, after reading what the client sent (briefly), so
  // that closing does not reset the connection before the client reads the answer.
  template <class Stream>
  awaitable<void> Refuse(Stream& stream) {
    beast::error_code ec;
    beast::flat_buffer buffer;
    http::request_parser<http::empty_body> parser;
    parser.header_limit(options.max_header_bytes);
    co_await http::async_read_header(stream, buffer, parser, redirect_error(use_awaitable, ec));
    if (ec == beast::error::timeout) co_return;
    const HttpHeaders retry_after = {{std::string("Retry-After"), std::string("1")}};
    co_await WriteSimple(stream, http::status::service_unavailable, 11,
                         ErrorBody(absl::StrCat("too many connections: the server allows ", options.max_connections,
                                                " at once (--max-connections); retry shortly"),
                                   "too_many_connections"),
                         retry_after);
  }

  template <class Stream>
  awaitable<void> Serve(Stream& stream, bool over) {
    if (over) {
      co_await Refuse(stream);
      co_return;
    }
    auto& lowest = beast::get_lowest_layer(stream);
    beast::flat_buffer buffer;
    for (bool first = true;; first = false) {
      http::request_parser<http::string_body> parser;
      parser.header_limit(options.max_header_bytes);
      parser.body_limit(options.max_body_bytes);
      beast::error_code ec;
      if (!first) {
        if (buffer.size() == 0) {
          // Idle between requests: wait for the next one's first bytes.
          lowest.expires_after(Ms(options.idle_timeout_s));
          size_t n = co_await stream.async_read_some(buffer.prepare(4096), redirect_error(use_awaitable, ec));
          if (ec) break;  // closed, reset or idle too long
          buffer.commit(n);
        }
        lowest.expires_after(Ms(options.receive_timeout_s));
      }
      co_await http::async_read_header(stream, buffer, parser, redirect_error(use_awaitable, ec));
      if (ec == http::error::end_of_stream || ec == beast::error::timeout || ec == net::error::eof ||
          ec == net::error::connection_reset || ec == ssl::error::stream_truncated) {
        break;
      }
      if (ec == http::error::body_limit) {  // a Content-Length over the limit fails the header read
        co_await WriteSimple(stream, http::status::payload_too_large, 11,
                             ErrorBody(absl::StrCat("the request body exceeds the limit of ", options.max_body_bytes,
                                                    " bytes (--max-body-bytes)"),
                                       "request_too_large"));
        break;
      }
      if (ec == http::error::header_limit) {
        co_await WriteSimple(stream, http::status::request_header_fields_too_large, 11,
                             ErrorBody(absl::StrCat("the request line and headers exceed the limit of ",
                                                    options.max_header_bytes, " bytes (--max-header-bytes)"),
                                       "request_header_too_large"));
        break;
      }
      if (ec) {
        co_await WriteSimple(stream, http::status::bad_request, 11,
                             ErrorBody(absl::StrCat("malformed HTTP request: ", ec.message()), "bad_request"));
        break;
      }
      auto& head = parser.get();
      if (parser.content_length() && *parser.content_length() > options.max_body_bytes) {
        co_await WriteSimple(stream, http::status::payload_too_large, head.version(),
                             ErrorBody(absl::StrCat("the request body has ", *parser.content_length(),
                                                    " bytes; the limit is ", options.max_body_bytes,
                                                    " (--max-body-bytes)"),
                                       "request_too_large"));
        break;
      }
      if (absl::EqualsIgnoreCase(std::string(head[http::field::expect]), "100-continue")) {
        http::response<http::empty_body> cont{http::status::continue_, head.version()};
        co_await http::async_write(stream, cont, redirect_error(use_awaitable, ec));
        if (ec) break;
      }
      if (!parser.is_done()) co_await http::async_read(stream, buffer, parser, redirect_error(use_awaitable, ec));
      if (ec == http::error::body_limit) {
        co_await WriteSimple(stream, http::status::payload_too_large, head.version(),
                             ErrorBody(absl::StrCat("the request body exceeds the limit of ", options.max_body_bytes,
                                                    " bytes (--max-body-bytes)"),
                                       "request_too_large"));
        break;
      }
      if (ec) {
        if (ec != http::error::end_of_stream && ec != beast::error::timeout && ec != net::error::eof &&
            ec != net::error::connection_reset && ec != ssl::error::stream_truncated) {
          co_await WriteSimple(stream, http::status::bad_request, 11,
                               ErrorBody(absl::StrCat("malformed HTTP request: ", ec.message()), "bad_request"));
        }
        break;
      }
      lowest.expires_never();
      http::request<http::string_body> req = parser.release();
      HttpRequest r;
      r.method = std::string(req.method_string());
      r.target = std::string(req.target());
      for (const auto& field : req) {
        r.headers[absl::AsciiStrToLower(std::string(field.name_string()))] = std::string(field.value());
      }
      r.body = std::move(req.body());
      const bool head_request = req.method() == http::verb::head;
      auto exchange = std::make_shared<BeastExchange>(stream.get_executor(), &active);
      try {
        handler(std::move(r), exchange);
      } catch (const std::exception& e) {
        NLOG(ERROR) << "http: handler threw: " << e.what();
        exchange->Respond(500, "application/json", ErrorBody("internal error", "internal_error"), {});
      }
      bool keep = co_await exchange->Drive(stream, req.version(), req.keep_alive(), head_request);
      if (!keep) break;
    }
  }
};

HttpServer::HttpServer(HttpServerOptions options, Handler handler) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  impl_->handler = std::move(handler);
}

HttpServer::~HttpServer() { Shutdown(); }

Status HttpServer::Start() {
  Impl& s = *impl_;
  const std::string where = absl::StrCat(s.options.host, ":", s.options.port);
  beast::error_code ec;
  auto address = net::ip::make_address(s.options.host, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("--host ", s.options.host, ": not an IP address (", ec.message(), ")"));
  tcp::endpoint endpoint(address, static_cast<unsigned short>(s.options.port));
  RETURN_IF_ERROR(s.SetUpTls());
  s.acceptor.open(endpoint.protocol(), ec);
  if (!ec) s.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) s.acceptor.bind(endpoint, ec);
  if (!ec) s.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return absl::UnavailableError(absl::StrCat(where, ": ", ec.message()));
  s.port = s.acceptor.local_endpoint().port();
  s.work.emplace(s.ioc.get_executor());
  net::co_spawn(s.ioc, s.Accept(), net::detached);
  for (int i = 0; i < std::max(1, s.options.threads); ++i) {
    s.threads.emplace_back([&s] { s.ioc.run(); });
  }
  return absl::OkStatus();
}

int HttpServer::port() const { return impl_->port; }

void HttpServer::StopAccepting() {
  net::post(impl_->ioc, [this] {
    beast::error_code ec;
    impl_->acceptor.close(ec);
  });
}

void HttpServer::Shutdown() {
  Impl& s = *impl_;
  if (s.threads.empty()) return;
  StopAccepting();
  s.work.reset();
  s.ioc.stop();
  for (auto& t : s.threads) t.join();
  s.threads.clear();
}

size_t HttpServer::active_exchanges() const { return impl_->active.load(); }

size_t HttpServer::open_connections() const { return static_cast<size_t>(std::max(0, impl_->connections.load())); }

}  // namespace numoe::router
