#include "tests/support/http.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "common/free_port.h"

namespace numoe::test {

int FreePort() { return ConsecutiveFreePorts(1); }

int ConsecutiveFreePorts(int n) {
  StatusOr<int> port = ReserveLocalPorts(n);
  if (!port.ok()) {
    std::fprintf(stderr, "FreePort: %s\n", std::string(port.status().message()).c_str());
    std::abort();
  }
  return *port;
}

namespace {

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// Reads more bytes into `out`: 1 = got data, 0 = EOF or error, -1 = timeout.
int ReadSome(int fd, std::string* out, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  int pr = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, timeout.count())));
  if (pr == 0) return -1;
  if (pr < 0) return 0;
  char buf[65536];
  ssize_t n = recv(fd, buf, sizeof(buf), 0);
  if (n <= 0) return 0;
  out->append(buf, static_cast<size_t>(n));
  return 1;
}

std::string BuildRequest(const std::string& method, const std::string& path, const std::string& body,
                         const std::vector<std::string>& headers) {
  std::string req = method + " " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n";
  for (const auto& h : headers) req += h + "\r\n";
  if (!body.empty() || method == "POST") {
    req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
  }
  req += "\r\n" + body;
  return req;
}

// Parses the status line and headers at the start of `raw`; returns the header size or 0 if incomplete.
size_t ParseHead(const std::string& raw, int* status, std::map<std::string, std::string>* headers) {
  size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return 0;
  std::istringstream in(raw.substr(0, end));
  std::string line;
  std::getline(in, line);
  if (line.size() > 12) *status = std::atoi(line.substr(9, 3).c_str());
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.erase(0, 1);
    (*headers)[name] = value;
  }
  return end + 4;
}

// Moves complete chunks from `raw` to `out`; returns true when the last chunk was seen.
bool Dechunk(std::string* raw, std::string* out) {
  for (;;) {
    size_t line_end = raw->find("\r\n");
    if (line_end == std::string::npos) return false;
    size_t size = std::strtoul(raw->substr(0, line_end).c_str(), nullptr, 16);
    if (size == 0) return true;
    if (raw->size() < line_end + 2 + size + 2) return false;
    out->append(*raw, line_end + 2, size);
    raw->erase(0, line_end + 2 + size + 2);
  }
}

}  // namespace

HttpResponse HttpCall(int port, const std::string& method, const std::string& path, const std::string& body,
                      const std::vector<std::string>& headers, std::chrono::milliseconds timeout) {
  HttpResponse r;
  int fd = Connect(port);
  if (fd < 0) {
    r.error = "connect failed";
    return r;
  }
  if (!SendAll(fd, BuildRequest(method, path, body, headers))) {
    // The server may answer (e.g. 413) and close before reading everything; read what it sent.
    r.error = "send failed";
  }
  std::string raw;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ReadSome(fd, &raw, std::chrono::milliseconds(200)) == 0) break;
  }
  close(fd);
  size_t head = ParseHead(raw, &r.status, &r.headers);
  if (head == 0) {
    r.status = 0;
    if (r.error.empty()) r.error = "no response";
    return r;
  }
  std::string rest = raw.substr(head);
  if (r.header("transfer-encoding") == "chunked") {
    Dechunk(&rest, &r.body);
  } else {
    r.body = rest;
  }
  return r;
}

RawConnection::RawConnection(int port) : fd_(Connect(port)) {}

RawConnection::~RawConnection() {
  if (fd_ >= 0) close(fd_);
}

bool RawConnection::Send(const std::string& bytes) { return fd_ >= 0 && SendAll(fd_, bytes); }

HttpResponse RawConnection::ReadResponse(std::chrono::milliseconds timeout) {
  HttpResponse r;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool eof = fd_ < 0;
  for (;;) {
    r.headers.clear();
    size_t head = ParseHead(raw_, &r.status, &r.headers);
    if (head > 0) {
      std::string rest = raw_.substr(head);
      if (r.header("transfer-encoding") == "chunked") {
        std::string body;
        if (Dechunk(&rest, &body)) {
          r.body = body;
          raw_.clear();  // (a pipelined next response is not expected by these tests)
          return r;
        }
      } else {
        const size_t length = std::strtoul(r.header("content-length").c_str(), nullptr, 10);
        if (rest.size() >= length) {
          r.body = rest.substr(0, length);
          raw_ = rest.substr(length);
          return r;
        }
      }
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (eof || left.count() <= 0) break;
    if (ReadSome(fd_, &raw_, left) == 0) eof = true;
  }
  r = HttpResponse();
  r.error = eof ? "closed before a whole response" : "timeout";
  return r;
}

bool RawConnection::WaitClosed(std::chrono::milliseconds timeout) {
  if (fd_ < 0) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    std::string ignored;
    int r = ReadSome(fd_, &ignored, left);
    if (r == 0) return true;
    if (r == -1) return false;
  }
}

std::string RawConnection::ReadBytes(size_t n, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (fd_ >= 0 && raw_.size() < n) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || ReadSome(fd_, &raw_, left) != 1) break;
  }
  std::string out = raw_.substr(0, std::min(n, raw_.size()));
  raw_.erase(0, out.size());
  return out;
}

bool SseStream::Open(int port, const std::string& path, const std::string& body,
                     const std::vector<std::string>& headers) {
  fd_ = Connect(port);
  if (fd_ < 0) return false;
  if (!SendAll(fd_, BuildRequest("POST", path, body, headers))) return false;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (;;) {
    size_t head = ParseHead(raw_, &status_, &headers_);
    if (head > 0) {
      raw_.erase(0, head);
      chunked_ = headers_["transfer-encoding"] == "chunked";
      return true;
    }
    if (std::chrono::steady_clock::now() >= deadline || ReadSome(fd_, &raw_, std::chrono::seconds(1)) == 0) return false;
  }
}

SseStream::~SseStream() { Close(); }

void SseStream::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

bool SseStream::Fill(std::chrono::milliseconds timeout) {
  if (eof_) return false;
  int r = ReadSome(fd_, &raw_, timeout);
  if (r == 0) eof_ = true;
  return r == 1;
}

void SseStream::Decode() {
  if (chunked_) {
    if (Dechunk(&raw_, &decoded_)) eof_ = true;
  } else {
    decoded_ += raw_;
    raw_.clear();
  }
}

std::string SseStream::NextEvent(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    Decode();
    size_t end = decoded_.find("\n\n");
    if (end != std::string::npos) {
      std::string ev = decoded_.substr(0, end);
      decoded_.erase(0, end + 2);
      if (ev.rfind("data: ", 0) == 0) return ev.substr(6);
      continue;
    }
    if (eof_ || std::chrono::steady_clock::now() >= deadline) return "";
    Fill(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  }
}

std::string SseStream::ReadBody(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    Decode();
    if (eof_ || std::chrono::steady_clock::now() >= deadline) break;
    Fill(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  }
  std::string body;
  body.swap(decoded_);
  return body;
}

std::vector<std::string> SseEvents(const std::string& body) {
  std::vector<std::string> out;
  size_t pos = 0;
  for (;;) {
    size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    std::string ev = body.substr(pos, end - pos);
    if (ev.rfind("data: ", 0) == 0) out.push_back(ev.substr(6));
    pos = end + 2;
  }
  return out;
}

double MetricSum(const std::string& page, const std::string& metric, const std::vector<std::string>& labels) {
  double sum = -1;
  std::istringstream in(page);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(metric + "{", 0) != 0) continue;
    const size_t close = line.find("} ", metric.size());
    if (close == std::string::npos) continue;
    const std::string have = line.substr(metric.size() + 1, close - metric.size() - 1);
    if (!std::all_of(labels.begin(), labels.end(),
                     [&](const std::string& l) { return have.find(l) != std::string::npos; })) {
      continue;
    }
    sum = std::max(sum, 0.0) + std::strtod(line.c_str() + close + 2, nullptr);
  }
  return sum;
}

}  // namespace numoe::test
