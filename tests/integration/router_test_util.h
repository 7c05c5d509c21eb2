// Helpers for the router's integration tests: child processes (fake workers, numoe-router) and a minimal
// blocking HTTP/1.1 client with server-sent-events parsing. Plain POSIX on purpose: the tests must not share
// code with the server they test.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace numoe::testing {

// A child process, killed (SIGKILL) and reaped on destruction unless already stopped.
class Child {
 public:
  Child() = default;
  // Starts argv[0] with the arguments; stdout+stderr go to `log_path` (appended), or stdout alone to
  // `stdout_path` when given. With new_group the child leads its own process group (pid == pgid).
  static Child Start(const std::vector<std::string>& argv, const std::string& log_path, bool new_group = false,
                     const std::string& stdout_path = "");
  Child(Child&& o) noexcept;
  Child& operator=(Child&& o) noexcept;
  ~Child();

  pid_t pid() const { return pid_; }
  bool running();
  void Signal(int sig);
  // Waits for exit up to `timeout`; returns the exit status (as from waitpid) or -1 on timeout.
  int Wait(std::chrono::milliseconds timeout);
  void Kill();  // SIGKILL + reap

 private:
  pid_t pid_ = -1;
};

// Processes of process group `pgid` (from /proc), as (pid, command name).
std::vector<std::pair<pid_t, std::string>> ProcessGroupMembers(pid_t pgid);
// A TCP port on 127.0.0.1 that was free a moment ago.
int FreePort();

// A fresh temporary directory (removed by the caller at will).
std::string MakeTempDir(const std::string& prefix);
// Waits until `path` exists and is non-empty, up to `timeout`; returns its contents ("" on timeout).
std::string WaitForFile(const std::string& path, std::chrono::milliseconds timeout);
std::string ReadFile(const std::string& path);

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
// SSE "data:" payload ("" at the end of the stream or on error).
class SseStream {
 public:
  bool Open(int port, const std::string& path, const std::string& body,
            const std::vector<std::string>& headers = {});
  ~SseStream();
  int status() const { return status_; }
  std::string NextEvent(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  void Close();

 private:
  bool Fill(std::chrono::milliseconds timeout);
  int fd_ = -1;
  int status_ = 0;
  bool chunked_ = false;
  std::string raw_;      // bytes read, not yet de-chunked
  std::string decoded_;  // de-chunked body bytes not yet returned
  bool eof_ = false;
};

// Splits an SSE body into its "data:" payloads.
std::vector<std::string> SseEvents(const std::string& body);

}  // namespace numoe::testing
