// A byte-progress line for long loads (the routed experts): done / total GB, a bar, GB/s and ETA.
// On a terminal it redraws one line with \r (at most 10 times a second); otherwise (logs, pipes) it
// prints one line per second. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>

namespace numoe::worker {

class ProgressBar {
 public:
  // `total_bytes` may be 0 when unknown (then no bar and no ETA).
  ProgressBar(std::string label, int64_t total_bytes, FILE* out = stderr);
  void Update(int64_t done_bytes);
  // Prints the final line (always, TTY or not).
  void Done(int64_t done_bytes);

  // The text of one line (exposed for tests).
  static std::string Format(const std::string& label, int64_t done, int64_t total, double seconds, int width);

 private:
  void Print(int64_t done, bool final);
  std::mutex mu_;
  std::string label_;
  int64_t total_;
  FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point start_, last_;
  bool printed_ = false;
};

}  // namespace numoe::worker
