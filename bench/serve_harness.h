// What the end-to-end benchmarks share (decode, and every other numoe-bench command that measures through
// the served stack): `numoe serve` as a child process on free loopback ports, a minimal HTTP/1.1 + SSE client,
// and one streamed completion timed event by event.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/args.h"
#include "common/status.h"
#include "common/topology.h"

namespace numoe::bench {

using Clock = std::chrono::steady_clock;

inline double Since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}
std::string Fmt(double v, int digits);  // "%.*f"
// Prints "<prog>: <message>" on stderr and returns 1, a failed benchmark's exit code.
int BenchFail(const char* prog, const Status& st);
// A human line on stdout (flushed), unless only the JSON line was asked for (--json).
void BenchSay(bool json_only, const std::string& line);

// The flags every end-to-end benchmark has, with their defaults as the benchmark sets them before
// AddServeBenchFlags: --log-dir, --startup-timeout, --request-timeout (its help: `request_timeout_help`), --json.
struct ServeBenchFlags {
  std::string log_dir;  // "" = a new directory under /tmp (MakeLogDir)
  double startup_timeout = 1800, request_timeout = 3600;
  bool json_only = false;
  // log_dir, or when unset /tmp/numoe-bench-<bench>-<pid>, created.
  const std::string& MakeLogDir(const std::string& bench);
};
void AddServeBenchFlags(ArgParser& p, ServeBenchFlags* flags, const std::string& request_timeout_help);

// A minimal HTTP/1.1 client for one request on loopback (Connection: close), with SSE event reading.
class SseClient {
 public:
  SseClient() = default;
  SseClient(const SseClient&) = delete;
  SseClient& operator=(const SseClient&) = delete;
  ~SseClient();

  // Connects, sends the request (POST `body`, or GET when `method` says so) and reads the response head.
  // Non-2xx: the body is in the error (FailedPrecondition, "HTTP <status>: <body>").
  Status Open(int port, const std::string& path, const std::string& body, Clock::time_point deadline,
              const std::string& method = "POST");
  // The whole (rest of the) body, to the end of the response.
  StatusOr<std::string> ReadAll(Clock::time_point deadline);
  // The next SSE "data:" payload, or nullopt at the end of the stream.
  StatusOr<std::optional<std::string>> Next(Clock::time_point deadline);
  // Connects and sends the request without waiting for an answer (Open = Send, then the response head).
  Status Send(int port, const std::string& path, const std::string& body, const std::string& method = "POST");
  // Closes the connection now (a client that goes away mid-stream).
  void Close();

 private:
  Status Fill(Clock::time_point deadline);
  void Decode();  // complete chunks (or everything, without chunked encoding) from raw_ to body_

  int fd_ = -1;
  bool chunked_ = false, eof_ = false;
  std::string raw_, body_;
};

// One streamed POST /v1/completions of token ids (greedy, ignore_eos, return_token_ids), every SSE event
// timestamped on arrival.
struct StreamResult {
  Status status;
  Clock::time_point sent;
  std::vector<std::pair<Clock::time_point, int>> events;  // arrival time, tokens in the event
  int64_t tokens = 0;
  std::string finish_reason;
  std::vector<int32_t> token_ids;                  // every token id received, in order
  int64_t prompt_tokens = -1, cached_tokens = -1;  // from the usage chunk, when it has them
};
// `response_format`: a JSON object to send as the request's response_format ("" = none). `stop`: when set, the
// stream is closed (and the result returned, status OK) at the first event after *stop becomes true.
StreamResult StreamCompletion(int port, const std::vector<int32_t>& prompt, int64_t max_tokens, double timeout_s,
                              const std::string& response_format = "", const std::atomic<bool>* stop = nullptr);

// The router's workers (GET /health: worker_list[].address).
StatusOr<std::vector<std::string>> WorkerAddresses(int port);

// A prompt of `len` ordinary token ids (DeepSeek's BPE range [3, 128000) where the vocabulary is that large),
// the same on every run for the same `stream`; different streams share no prefix.
std::vector<int32_t> RandomPrompt(int64_t len, uint64_t stream, int64_t vocab);

// Worker-0's placement as `numoe serve --workers N [--threads-per-worker T]` gives it on this machine (the one
// rule of deploy/placement.h): where the benchmarks measure read bandwidth and peak FLOP/s before serving.
StatusOr<WorkerPlacement> Worker0Placement(int64_t workers, int64_t threads);

std::string TailOf(const std::string& path, size_t bytes);  // the last `bytes` of a file
std::string BinDir();  // the directory of this executable (numoe is next to numoe-bench)

// `numoe serve` (or any command) as a child in its own process group, stdout read for the ready line,
// stderr to a log file.
class ServeProcess {
 public:
  ServeProcess() = default;
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  ~ServeProcess() { Stop(5.0); }

  Status Start(const std::vector<std::string>& argv, const std::string& log_path);
  // The ready line from serve's stdout.
  StatusOr<std::string> WaitReady(double timeout_s);
  // SIGTERM to serve (it stops its children), SIGKILL to the whole group after `timeout_s`.
  void Stop(double timeout_s);
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string log_path_;
};

// What every benchmark passes to `numoe serve`.
struct ServeSpec {
  std::string model, backend = "cpu", spec = "auto", log_dir;
  int64_t workers = 1, threads = 0, lanes = -1;
  double sim_expert_gbps = 0;
  int affinity_prefix_tokens = 0;          // 0: balance by outstanding work alone (prompts share no prefix); -1: serve's default
  std::vector<std::string> extra;          // further serve flags, passed as given
};
struct ServeEndpoints {
  int port = 0, grpc_port = 0;
  std::vector<std::string> argv;
};
// Picks free ports and builds serve's command line (BinDir()/numoe serve ...).
StatusOr<ServeEndpoints> ServeCommand(const ServeSpec& spec);

}  // namespace numoe::bench
