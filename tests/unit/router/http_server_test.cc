// The REST server's limits over real loopback sockets: the receive deadline (a client sending a byte at a
// time is cut off; the deadline is per request, not per connection), the keep-alive idle timeout, too
// many connections (503 + Retry-After), headers and bodies too large; and the TLS files' checks.
#include "router/http/http_server.h"

#include <atomic>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include "router/http/tls.h"
#include "tests/support/files.h"
#include "tests/support/http.h"
#include "tests/support/status_matchers.h"
#include "tests/support/tls_cert.h"

namespace numoe::router {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using test::HttpResponse;
using test::RawConnection;

const std::string kGet = "GET /x HTTP/1.1\r\nHost: t\r\n\r\n";

// A server on a free port whose handler answers 200 with the request's body size.
class Server {
 public:
  explicit Server(HttpServerOptions o) {
    o.host = "127.0.0.1";
    o.port = 0;
    server_ = std::make_unique<HttpServer>(o, [this](HttpRequest req, std::shared_ptr<HttpExchange> ex) {
      requests_.fetch_add(1);
      ex->Respond(200, "text/plain", std::to_string(req.body.size()), {});
    });
    status_ = server_->Start();
  }
  const Status& status() const { return status_; }
  int port() const { return server_->port(); }
  int requests() const { return requests_.load(); }
  HttpServer& http() { return *server_; }

  // Waits until `n` connections are open (the server counts them as it accepts).
  bool WaitConnections(size_t n) {
    for (auto deadline = Clock::now() + 5s; Clock::now() < deadline; std::this_thread::sleep_for(5ms)) {
      if (server_->open_connections() == n) return true;
    }
    return false;
  }

 private:
  std::atomic<int> requests_{0};
  std::unique_ptr<HttpServer> server_;
  Status status_;
};

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

TEST(HttpServerLimits, SlowClientIsCutOffAtTheReceiveDeadline) {
  Server s(HttpServerOptions{.receive_timeout_s = 1.0, .idle_timeout_s = 60});
  ASSERT_OK(s.status());
  // One byte every 100 ms, headers and body: 110 bytes would take 11 s.
  const std::string request =
      "POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 40\r\n\r\n" + std::string(40, 'a');
  RawConnection c(s.port());
  ASSERT_TRUE(c.connected());
  const auto start = Clock::now();
  size_t sent = 0;
  bool closed = false;
  while (sent < request.size() && Since(start) < 5) {
    if (!c.Send(request.substr(sent, 1))) break;  // reset by the server
    ++sent;
    if (c.WaitClosed(100ms)) {
      closed = true;
      break;
    }
  }
  const double cut = Since(start);
  EXPECT_TRUE(closed || sent < request.size()) << "the slow client was not cut off";
  EXPECT_LT(sent, request.size());
  EXPECT_GE(cut, 0.9);
  EXPECT_LE(cut, 2.0) << "cut off late: after " << cut << " s";
  EXPECT_EQ(s.requests(), 0);

  // A slow body after quick headers is cut off the same way.
  RawConnection b(s.port());
  ASSERT_TRUE(b.Send("POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 40\r\n\r\n"));
  const auto body_start = Clock::now();
  bool body_closed = false;
  for (int i = 0; i < 40 && Since(body_start) < 5; ++i) {
    if (!b.Send("a") || b.WaitClosed(100ms)) {
      body_closed = true;
      break;
    }
  }
  EXPECT_TRUE(body_closed);
  EXPECT_LE(Since(body_start), 2.0);
  EXPECT_EQ(s.requests(), 0);
}

TEST(HttpServerLimits, ReceiveDeadlineIsPerRequestAndIdleTimeoutClosesKeepAlive) {
  Server s(HttpServerOptions{.receive_timeout_s = 0.6, .idle_timeout_s = 0.4});
  ASSERT_OK(s.status());
  RawConnection c(s.port());
  // Three requests on one keep-alive connection, 0.3 s apart: 0.9 s in all, past one receive deadline;
  // each request and each idle gap is within its own limit.
  for (int i = 0; i < 3; ++i) {
    if (i > 0) std::this_thread::sleep_for(300ms);
    ASSERT_TRUE(c.Send(kGet)) << i;
    HttpResponse r = c.ReadResponse(5s);
    ASSERT_EQ(r.status, 200) << i << " " << r.error;
  }
  // Then idle: closed after about idle_timeout_s.
  const auto idle_start = Clock::now();
  EXPECT_TRUE(c.WaitClosed(3s));
  EXPECT_GE(Since(idle_start), 0.3);
  EXPECT_LE(Since(idle_start), 1.5);

  // A connection that never sends a byte is closed at the receive deadline (the idle timeout is only for
  // keep-alive connections between requests).
  Server longer(HttpServerOptions{.receive_timeout_s = 0.5, .idle_timeout_s = 60});
  RawConnection silent(longer.port());
  const auto t = Clock::now();
  EXPECT_TRUE(silent.WaitClosed(3s));
  EXPECT_LE(Since(t), 1.5);
}

TEST(HttpServerLimits, TooManyConnectionsGet503WithRetryAfter) {
  Server s(HttpServerOptions{.max_connections = 2});
  ASSERT_OK(s.status());
  auto a = std::make_unique<RawConnection>(s.port());
  RawConnection b(s.port());
  ASSERT_TRUE(s.WaitConnections(2));
  {
    RawConnection third(s.port());
    ASSERT_TRUE(third.Send(kGet));
    HttpResponse r = third.ReadResponse(5s);
    EXPECT_EQ(r.status, 503) << r.error;
    EXPECT_EQ(r.header("retry-after"), "1");
    EXPECT_NE(r.body.find("--max-connections"), std::string::npos) << r.body;
    EXPECT_TRUE(third.WaitClosed(2s));
  }
  EXPECT_EQ(s.http().open_connections(), 2u);
  // The two admitted connections still work.
  ASSERT_TRUE(b.Send(kGet));
  EXPECT_EQ(b.ReadResponse(5s).status, 200);
  // One leaves: a new connection is admitted.
  a.reset();
  ASSERT_TRUE(s.WaitConnections(1));
  RawConnection d(s.port());
  ASSERT_TRUE(d.Send(kGet));
  EXPECT_EQ(d.ReadResponse(5s).status, 200);
}

TEST(HttpServerLimits, HeadersTooLargeGet431) {
  Server s(HttpServerOptions{.max_header_bytes = 2048});
  ASSERT_OK(s.status());
  RawConnection ok(s.port());
  ASSERT_TRUE(ok.Send("GET /x HTTP/1.1\r\nHost: t\r\nX-Pad: " + std::string(1500, 'p') + "\r\n\r\n"));
  EXPECT_EQ(ok.ReadResponse(5s).status, 200);
  RawConnection big(s.port());
  big.Send("GET /x HTTP/1.1\r\nHost: t\r\nX-Pad: " + std::string(4000, 'p') + "\r\n\r\n");
  HttpResponse r = big.ReadResponse(5s);
  EXPECT_EQ(r.status, 431) << r.error;
  EXPECT_NE(r.body.find("2048 bytes (--max-header-bytes)"), std::string::npos) << r.body;
  // Many small headers count too.
  std::string many = "GET /x HTTP/1.1\r\nHost: t\r\n";
  for (int i = 0; i < 300; ++i) many += "X-H" + std::to_string(i) + ": v\r\n";
  RawConnection m(s.port());
  m.Send(many + "\r\n");
  EXPECT_EQ(m.ReadResponse(5s).status, 431);
  EXPECT_EQ(s.requests(), 1);
}

TEST(HttpServerLimits, BodiesTooLargeGet413) {
  Server s(HttpServerOptions{.max_body_bytes = 1024});
  ASSERT_OK(s.status());
  RawConnection ok(s.port());
  ASSERT_TRUE(ok.Send("POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1024\r\n\r\n" + std::string(1024, 'b')));
  HttpResponse r = ok.ReadResponse(5s);
  EXPECT_EQ(r.status, 200);
  EXPECT_EQ(r.body, "1024");
  // Declared too large: answered before any body byte is sent.
  RawConnection declared(s.port());
  ASSERT_TRUE(declared.Send("POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 1025\r\n\r\n"));
  r = declared.ReadResponse(5s);
  EXPECT_EQ(r.status, 413) << r.error;
  EXPECT_NE(r.body.find("--max-body-bytes"), std::string::npos) << r.body;
  // Chunked, growing past the limit.
  RawConnection chunked(s.port());
  chunked.Send("POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n" + std::string(1024, 'c') +
               "\r\n10\r\n" + std::string(16, 'c') + "\r\n0\r\n\r\n");
  r = chunked.ReadResponse(5s);
  EXPECT_EQ(r.status, 413) << r.error;
  EXPECT_EQ(s.requests(), 1);
}

TEST(TlsFiles, Checked) {
  test::TempDir dir("tls-files");
  test::TestCertificate a = test::MakeTestCertificate(dir.str(), "a");
  if (!a.error.empty()) GTEST_SKIP() << a.error;
  test::TestCertificate b = test::MakeTestCertificate(dir.str(), "b");
  ASSERT_EQ(b.error, "");

  ASSERT_OK_AND_ASSIGN(TlsPem off, LoadTlsPem("", ""));
  EXPECT_FALSE(off.enabled());
  ASSERT_OK_AND_ASSIGN(TlsPem on, LoadTlsPem(a.cert, a.key));
  EXPECT_TRUE(on.enabled());
  EXPECT_NE(on.cert_chain.find("BEGIN CERTIFICATE"), std::string::npos);

  auto message = [](const StatusOr<TlsPem>& s) { return std::string(s.status().message()); };
  EXPECT_EQ(message(LoadTlsPem(a.cert, "")), "--tls-cert needs --tls-key (the private key's PEM file)");
  EXPECT_EQ(message(LoadTlsPem("", a.key)), "--tls-key needs --tls-cert (the certificate's PEM file)");
  EXPECT_EQ(message(LoadTlsPem(dir / "none.crt", a.key)), "--tls-cert " + (dir / "none.crt") + ": cannot open the file");
  ASSERT_TRUE(test::WriteFile(dir / "junk.pem", "not a certificate\n"));
  EXPECT_EQ(message(LoadTlsPem(dir / "junk.pem", a.key)).rfind("--tls-cert " + (dir / "junk.pem") + ": not a PEM certificate", 0), 0u);
  EXPECT_EQ(message(LoadTlsPem(a.cert, dir / "junk.pem")).rfind("--tls-key " + (dir / "junk.pem") + ": not an unencrypted PEM private key", 0), 0u);
  EXPECT_EQ(message(LoadTlsPem(a.cert, a.cert)).rfind("--tls-key " + a.cert + ": not an unencrypted PEM private key", 0), 0u);
  EXPECT_EQ(message(LoadTlsPem(a.cert, b.key)),
            "--tls-key " + b.key + ": the key does not match the certificate in --tls-cert " + a.cert);

  // The server takes the PEM text; plain HTTP to an HTTPS port gets no HTTP answer.
  Server s(HttpServerOptions{.receive_timeout_s = 2, .tls_cert_chain_pem = on.cert_chain,
                             .tls_private_key_pem = on.private_key});
  ASSERT_OK(s.status());
  RawConnection plain(s.port());
  plain.Send(kGet);
  EXPECT_EQ(plain.ReadResponse(3s).status, 0);
}

}  // namespace
}  // namespace numoe::router
