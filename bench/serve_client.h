// What the benchmarks that run `numoe serve` share: a minimal loopback HTTP/1.1 client for one streaming
// request (SseClient), one streamed /v1/completions (StreamCompletion), free loopback ports and
// `numoe serve` as a child process group (ServeProcess). Used by numoe-bench decode and numoe-bench prefix.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace numoe::bench {

using Clock = std::chrono::steady_clock;

std::string TailOf(const std::string& path, size_t bytes);

// ---- a minimal HTTP/1.1 client for one streaming POST on loopback ----------------------------------------

class SseClient {
 public:
  ~SseClient() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Connects, sends the request (POST `body`, or GET when `method` says so) and reads the response head.
  // Non-2xx: the body is in the error.
  Status Open(int port, const std::string& path, const std::string& body, Clock::time_point deadline,
              const std::string& method = "POST") {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return absl::InternalError("socket() failed");
    const int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
      return absl::UnavailableError(absl::StrCat("connect to 127.0.0.1:", port, ": ", std::strerror(errno)));
    const std::string req = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1:", port,
                                         "\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
                                         "Connection: close\r\nContent-Length: ",
                                         body.size(), "\r\n\r\n", body);
    for (size_t off = 0; off < req.size();) {
      const ssize_t n = ::send(fd_, req.data() + off, req.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
      off += static_cast<size_t>(n);
    }
    size_t end;
    while ((end = raw_.find("\r\n\r\n")) == std::string::npos) RETURN_IF_ERROR(Fill(deadline));
    const std::string head = raw_.substr(0, end);
    raw_.erase(0, end + 4);
    int status = 0;
    if (std::sscanf(head.c_str(), "HTTP/1.%*d %d", &status) != 1)
      return absl::DataLossError("bad HTTP status line: " + head.substr(0, head.find('\r')));
    std::string lower = head;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    chunked_ = lower.find("transfer-encoding: chunked") != std::string::npos;
    if (status < 200 || status >= 300) {
      while (!eof_ && Fill(deadline).ok()) {
      }
      Decode();
      return absl::FailedPreconditionError(absl::StrCat("HTTP ", status, ": ", body_.substr(0, 500)));
    }
    return absl::OkStatus();
  }

  // The whole (rest of the) body, to the end of the response.
  StatusOr<std::string> ReadAll(Clock::time_point deadline) {
    while (!eof_) RETURN_IF_ERROR(Fill(deadline));
    Decode();
    return std::move(body_);
  }

  // The next SSE "data:" payload, or nullopt at the end of the stream.
  StatusOr<std::optional<std::string>> Next(Clock::time_point deadline) {
    for (;;) {
      Decode();
      const size_t end = body_.find("\n\n");
      if (end != std::string::npos) {
        std::string event = body_.substr(0, end);
        body_.erase(0, end + 2);
        std::string data;
        for (size_t pos = 0; pos <= event.size();) {
          size_t nl = event.find('\n', pos);
          if (nl == std::string::npos) nl = event.size();
          if (event.compare(pos, 5, "data:") == 0) {
            size_t from = pos + 5;
            if (from < nl && event[from] == ' ') ++from;
            data.append(event, from, nl - from);
          }
          pos = nl + 1;
        }
        if (data.empty()) continue;  // comments, keep-alives
        return std::optional<std::string>(std::move(data));
      }
      if (eof_) return std::optional<std::string>();
      RETURN_IF_ERROR(Fill(deadline));
    }
  }

 private:
  Status Fill(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return absl::DeadlineExceededError("no response within the request timeout");
    pollfd p{fd_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return absl::InternalError("poll failed");
    if (r <= 0) return absl::OkStatus();
    char buf[16384];
    const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
    if (n < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    if (n == 0) {
      eof_ = true;
      return absl::OkStatus();
    }
    raw_.append(buf, static_cast<size_t>(n));
    return absl::OkStatus();
  }
  // Moves complete chunks (or everything, without chunked encoding) from raw_ to body_.
  void Decode() {
    if (!chunked_) {
      body_ += raw_;
      raw_.clear();
      return;
    }
    for (;;) {
      const size_t eol = raw_.find("\r\n");
      if (eol == std::string::npos) return;
      const size_t size = std::strtoul(raw_.substr(0, eol).c_str(), nullptr, 16);
      if (size == 0) {
        eof_ = true;
        raw_.clear();
        return;
      }
      if (raw_.size() < eol + 2 + size + 2) return;
      body_.append(raw_, eol + 2, size);
      raw_.erase(0, eol + 2 + size + 2);
    }
  }

  int fd_ = -1;
  bool chunked_ = false, eof_ = false;
  std::string raw_, body_;
};

// ---- one streamed completion ------------------------------------------------------------------------------


struct StreamResult {
  Status status;
  Clock::time_point sent;
  std::vector<std::pair<Clock::time_point, int>> events;  // arrival time, tokens in the event
  int64_t tokens = 0;
  std::string finish_reason;
  std::vector<int32_t> token_ids;  // every token id received, in order
  int64_t cached_tokens = -1;  // the usage chunk's prompt_tokens_details.cached_tokens (-1: none came)
};


// One streamed greedy /v1/completions of `prompt` (ids), EOS ignored, usage included; every event timestamped.
StreamResult StreamCompletion(int port, const std::vector<int32_t>& prompt, int64_t max_tokens, double timeout_s);

StatusOr<int> FreePort();

class ServeProcess {
 public:
  ~ServeProcess() { Stop(5.0); }

  Status Start(const std::vector<std::string>& argv, const std::string& log_path) {
    log_path_ = log_path;
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
    const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log < 0) return absl::PermissionDeniedError(absl::StrCat(log_path, ": cannot create"));
    pid_ = ::fork();
    if (pid_ < 0) return absl::InternalError("fork failed");
    if (pid_ == 0) {
      ::setpgid(0, 0);  // serve and its children form one group: stopped together, never orphaned
      ::dup2(fds[1], 1);
      ::dup2(log, 2);
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid_, pid_);
    ::close(fds[1]);
    ::close(log);
    out_fd_ = fds[0];
    return absl::OkStatus();
  }

  // The ready line from serve's stdout.
  StatusOr<std::string> WaitReady(double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    std::string out;
    while (Clock::now() < deadline) {
      pollfd p{out_fd_, POLLIN, 0};
      if (::poll(&p, 1, 500) > 0) {
        char buf[1024];
        const ssize_t n = ::read(out_fd_, buf, sizeof(buf));
        if (n > 0) out.append(buf, static_cast<size_t>(n));
        const size_t nl = out.find('\n');
        if (nl != std::string::npos) return out.substr(0, nl);
        if (n == 0) break;  // stdout closed: serve exited
      }
      int status;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return absl::UnavailableError(absl::StrCat("numoe serve exited before it was ready; its log (", log_path_,
                                                   ") ends with:\n", TailOf(log_path_, 3000)));
      }
    }
    return absl::DeadlineExceededError(absl::StrCat("numoe serve was not ready within ", timeout_s, " s; log: ",
                                                    log_path_, "\n", TailOf(log_path_, 2000)));
  }

  // SIGTERM to serve (it stops its children), SIGKILL to the whole group after `timeout_s`.
  void Stop(double timeout_s) {
    if (out_fd_ >= 0) ::close(out_fd_);
    out_fd_ = -1;
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    while (Clock::now() < deadline) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        ::kill(-pid_, SIGKILL);  // anything of the group left behind
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string log_path_;
};


// The directory of this executable (numoe sits next to numoe-bench).
std::string BinDir();
std::string Fmt(double v, int digits);

}  // namespace numoe::bench
