// A minimal blocking HTTP/1.1 client for tests on loopback, with server-sent-events parsing. Plain POSIX on
// purpose: the tests must not share code with the server they test.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace numoe::test {

// A free port no other test or daemon on this machine was handed recently (common/free_port.h); aborts if
// there is none.
int FreePort();
// The first of `n` such consecutive ports (daemon i listens on first + i).
int ConsecutiveFreePorts(int n);

struct HttpResponse {
  int status = 0;  // 0 = connection failed
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;  // de-chunked
  std::string error;
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

// One request on a new connection ("Connection: close"). `headers` are extra "Name: value" lines.
HttpResponse HttpCall(int port, const std::string& method, const std::string& path, const std::string& body = "",
                      const std::vector<std::string>& headers = {},
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));

// A streaming request read incrementally: Open sends it and reads the headers; NextEvent returns the next
// SSE "data:" payload ("" at the end of the stream, on error or on timeout: eof() tells the first two from
// the last). A non-2xx answer is no event stream: ReadBody returns its body.
class SseStream {
 public:
  bool Open(int port, const std::string& path, const std::string& body,
            const std::vector<std::string>& headers = {});
  ~SseStream();
  int status() const { return status_; }
  // The response's headers (lower-case names), once Open returned true.
  const std::map<std::string, std::string>& headers() const { return headers_; }
  std::string header(const std::string& name) const {
    auto it = headers_.find(name);
    return it == headers_.end() ? std::string() : it->second;
  }
  std::string NextEvent(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // True once the server closed the connection (or it failed), or the chunked body ended.
  bool eof() const { return eof_; }
  // The rest of the body, de-chunked, read until the end of the response or `timeout`.
  std::string ReadBody(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  void Close();

 private:
  bool Fill(std::chrono::milliseconds timeout);
  // Moves what raw_ holds of the body into decoded_ (de-chunked when chunked; the last chunk sets eof_).
  void Decode();
  int fd_ = -1;
  int status_ = 0;
  std::map<std::string, std::string> headers_;
  bool chunked_ = false;
  std::string raw_;      // bytes read, not yet de-chunked
  std::string decoded_;  // de-chunked body bytes not yet returned
  bool eof_ = false;
};

// A raw connection for tests of the HTTP layer itself (limits, timeouts, keep-alive): bytes in, bytes out.
class RawConnection {
 public:
  explicit RawConnection(int port);  // connects to 127.0.0.1:port (connected() says whether it did)
  ~RawConnection();
  RawConnection(const RawConnection&) = delete;
  RawConnection& operator=(const RawConnection&) = delete;

  bool connected() const { return fd_ >= 0; }
  // False when the server has closed or reset the connection (no SIGPIPE).
  bool Send(const std::string& bytes);
  // Reads until one whole response is there (headers, then Content-Length bytes or the last chunk), the
  // server closes, or `timeout`; the response (status 0 when none came).
  HttpResponse ReadResponse(std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // Whether the server closed (or reset) the connection within `timeout`; bytes it sent first are dropped.
  bool WaitClosed(std::chrono::milliseconds timeout);
  // Raw bytes (another protocol than HTTP/1.1, e.g. HTTP/2 frames): reads until `n` bytes are there, the
  // server closes, or `timeout`; returns them (fewer than n when it closed or the time ran out).
  std::string ReadBytes(size_t n, std::chrono::milliseconds timeout);

 private:
  int fd_ = -1;
  std::string raw_;
};

// Splits an SSE body into its "data:" payloads.
std::vector<std::string> SseEvents(const std::string& body);

// The sum of the values of the `metric`{labels} lines of a Prometheus text page (/metrics) whose labels
// contain every one of `labels` (each like "tier=\"host\""), or -1 when no line matches.
double MetricSum(const std::string& page, const std::string& metric, const std::vector<std::string>& labels = {});

}  // namespace numoe::test
