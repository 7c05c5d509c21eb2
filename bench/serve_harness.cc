#include "bench/serve_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/free_port.h"
#include "common/hash.h"
#include "deploy/placement.h"
#include "nlohmann/json.hpp"

namespace numoe::bench {

namespace fs = std::filesystem;
using json = nlohmann::json;

SseClient::~SseClient() {
  if (fd_ >= 0) ::close(fd_);
}

Status SseClient::Send(int port, const std::string& path, const std::string& body, const std::string& method) {
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
  return absl::OkStatus();
}

// Send, then the response head. Non-2xx: the body is in the error.
Status SseClient::Open(int port, const std::string& path, const std::string& body, Clock::time_point deadline,
                       const std::string& method) {
  RETURN_IF_ERROR(Send(port, path, body, method));
  size_t end;
  while ((end = raw_.find("\r\n\r\n")) == std::string::npos) {
    if (eof_) return absl::UnavailableError("the server closed the connection before the response head");
    RETURN_IF_ERROR(Fill(deadline));
  }
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
StatusOr<std::string> SseClient::ReadAll(Clock::time_point deadline) {
  while (!eof_) RETURN_IF_ERROR(Fill(deadline));
  Decode();
  return std::move(body_);
}

// The next SSE "data:" payload, or nullopt at the end of the stream.
StatusOr<std::optional<std::string>> SseClient::Next(Clock::time_point deadline) {
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

Status SseClient::Fill(Clock::time_point deadline) {
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
void SseClient::Decode() {
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

void SseClient::Close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  eof_ = true;
}

StreamResult StreamCompletion(int port, const std::vector<int32_t>& prompt, int64_t max_tokens, double timeout_s,
                              const std::string& response_format, const std::atomic<bool>* stop) {
  StreamResult r;
  json body = {{"prompt", prompt},   {"max_tokens", max_tokens}, {"ignore_eos", true},
               {"temperature", 0.0}, {"stream", true},           {"return_token_ids", true},
               {"stream_options", {{"include_usage", true}}}};
  if (!response_format.empty()) body["response_format"] = json::parse(response_format);
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  SseClient client;
  r.sent = Clock::now();
  r.status = client.Open(port, "/v1/completions", body.dump(), deadline);
  if (!r.status.ok()) return r;
  for (;;) {
    if (stop != nullptr && stop->load()) {
      client.Close();
      return r;
    }
    auto next = client.Next(deadline);
    if (!next.ok()) {
      r.status = next.status();
      return r;
    }
    const auto now = Clock::now();
    if (!next->has_value() || **next == "[DONE]") break;
    const json chunk = json::parse(**next, nullptr, /*allow_exceptions=*/false);
    if (chunk.is_discarded()) {
      r.status = absl::DataLossError("unparsable SSE event: " + (*next)->substr(0, 200));
      return r;
    }
    if (chunk.contains("error")) {
      r.status = absl::InternalError("error event: " + chunk["error"].dump());
      return r;
    }
    if (chunk.contains("usage") && chunk["usage"].is_object()) {
      const json& u = chunk["usage"];
      if (u.contains("prompt_tokens") && u["prompt_tokens"].is_number_integer()) r.prompt_tokens = u["prompt_tokens"];
      if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object() &&
          u["prompt_tokens_details"].contains("cached_tokens") &&
          u["prompt_tokens_details"]["cached_tokens"].is_number_integer()) {
        r.cached_tokens = u["prompt_tokens_details"]["cached_tokens"];
      }
    }
    if (!chunk.contains("choices") || chunk["choices"].empty()) continue;  // the usage chunk
    const json& c = chunk["choices"][0];
    int n = 0;
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      n = static_cast<int>(c["token_ids"].size());
      for (const json& id : c["token_ids"]) r.token_ids.push_back(id.get<int32_t>());
    }
    if (c.contains("finish_reason") && c["finish_reason"].is_string()) r.finish_reason = c["finish_reason"];
    if (n > 0) {
      r.events.push_back({now, n});
      r.tokens += n;
    }
  }
  return r;
}

// The router's workers (GET /health: worker_list[].address).
StatusOr<std::vector<std::string>> WorkerAddresses(int port) {
  SseClient client;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  RETURN_IF_ERROR(client.Open(port, "/health", "", deadline, "GET"));
  ASSIGN_OR_RETURN(std::string body, client.ReadAll(deadline));
  const json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.contains("worker_list") || !j["worker_list"].is_array()) {
    return absl::DataLossError("the router's /health has no worker_list: " + body.substr(0, 200));
  }
  std::vector<std::string> out;
  for (const json& w : j["worker_list"]) {
    if (w.contains("address") && w["address"].is_string()) out.push_back(w["address"]);
  }
  if (out.empty()) return absl::DataLossError("the router's /health lists no worker");
  return out;
}

std::vector<int32_t> RandomPrompt(int64_t len, uint64_t stream, int64_t vocab) {
  // Ordinary (non-special) ids: DeepSeek's BPE range [3, 128000) where the vocabulary is that large.
  const int64_t hi = std::min<int64_t>(vocab, 128000), lo = std::min<int64_t>(3, hi - 1);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < len; ++i)
    ids.push_back(static_cast<int32_t>(lo + static_cast<int64_t>(SplitMix64(stream * 1000003 + i) % (hi - lo))));
  return ids;
}

// Worker-0's placement as `numoe serve --workers N [--threads-per-worker T]` gives it: the one rule of
// deploy/placement.h on this machine.
StatusOr<WorkerPlacement> Worker0Placement(int64_t workers, int64_t threads) {
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  ASSIGN_OR_RETURN(std::vector<WorkerPlacement> placed,
                   deploy::PlaceWorkers(topology, {.workers = static_cast<int>(workers),
                                                   .threads_per_worker = static_cast<int>(threads),
                                                   .threads_flag = "--threads"}));
  return placed.front();
}

std::string TailOf(const std::string& path, size_t bytes) {
  std::ifstream f(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return s.size() > bytes ? "..." + s.substr(s.size() - bytes) : s;
}

Status ServeProcess::Start(const std::vector<std::string>& argv, const std::string& log_path) {
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
StatusOr<std::string> ServeProcess::WaitReady(double timeout_s) {
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
void ServeProcess::Stop(double timeout_s) {
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

std::string BinDir() {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

int BenchFail(const char* prog, const Status& st) {
  std::fprintf(stderr, "%s: %s\n", prog, std::string(st.message()).c_str());
  return 1;
}

void BenchSay(bool json_only, const std::string& line) {
  if (!json_only) std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void AddServeBenchFlags(ArgParser& p, ServeBenchFlags* f, const std::string& request_timeout_help) {
  p.AddString("log-dir", "DIR", "where serve and its children log (default: a new directory under /tmp)", &f->log_dir);
  p.AddDouble("startup-timeout", "S", "give up when serve is not ready after this long", &f->startup_timeout, 1, 86400);
  p.AddDouble("request-timeout", "S", request_timeout_help, &f->request_timeout, 1, 86400);
  p.AddFlag("json", "print only the JSON line (the last line is JSON either way)", &f->json_only);
}

const std::string& ServeBenchFlags::MakeLogDir(const std::string& bench) {
  if (log_dir.empty()) {
    log_dir = (std::filesystem::temp_directory_path() / absl::StrCat("numoe-bench-", bench, "-", ::getpid())).string();
  }
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  return log_dir;
}

std::string Fmt(double v, int digits) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.*f", digits, v);
  return b;
}

StatusOr<ServeEndpoints> ServeCommand(const ServeSpec& s) {
  ServeEndpoints e;
  ASSIGN_OR_RETURN(e.port, ReserveLocalPort());
  ASSIGN_OR_RETURN(e.grpc_port, ReserveLocalPort());
  e.argv = {BinDir() + "/numoe", "serve", "--model", s.model, "--workers", std::to_string(s.workers),
            "--backend", s.backend, "--port", std::to_string(e.port), "--grpc-port", std::to_string(e.grpc_port),
            "--spec", s.spec};
  if (s.affinity_prefix_tokens >= 0) {
    e.argv.insert(e.argv.end(), {"--affinity-prefix-tokens", std::to_string(s.affinity_prefix_tokens)});
  }
  if (!s.log_dir.empty()) e.argv.insert(e.argv.end(), {"--log-dir", s.log_dir});
  if (s.threads > 0) e.argv.insert(e.argv.end(), {"--threads-per-worker", std::to_string(s.threads)});
  if (s.lanes >= 0) e.argv.insert(e.argv.end(), {"--lanes", std::to_string(s.lanes)});
  if (s.sim_expert_gbps > 0) e.argv.insert(e.argv.end(), {"--sim-expert-gbps", absl::StrCat(s.sim_expert_gbps)});
  e.argv.insert(e.argv.end(), s.extra.begin(), s.extra.end());
  return e;
}

}  // namespace numoe::bench
