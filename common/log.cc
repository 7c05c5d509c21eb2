#include "common/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>

namespace numoe::log {
namespace {

Level InitialThreshold() {
  const char* env = std::getenv("NUMOE_LOG_LEVEL");
  if (env == nullptr) return Level::kInfo;
  std::string v(env);
  if (v == "debug") return Level::kDebug;
  if (v == "warning") return Level::kWarning;
  if (v == "error") return Level::kError;
  return Level::kInfo;
}

std::atomic<int>& Threshold() {
  static std::atomic<int> t{static_cast<int>(InitialThreshold())};
  return t;
}

const char* Letter(Level l) {
  switch (l) {
    case Level::kDebug: return "D";
    case Level::kInfo: return "I";
    case Level::kWarning: return "W";
    case Level::kError: return "E";
    case Level::kFatal: return "F";
  }
  return "?";
}

}  // namespace

bool Enabled(Level level) { return static_cast<int>(level) >= Threshold().load(std::memory_order_relaxed); }
void SetThreshold(Level level) { Threshold().store(static_cast<int>(level)); }

Message::Message(Level level, const char* file, int line) : level_(level), file_(file), line_(line) {}

Message::~Message() {
  auto now = std::chrono::system_clock::now();
  std::time_t t = std::chrono::system_clock::to_time_t(now);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  localtime_r(&t, &tm);
  char ts[32];
  std::strftime(ts, sizeof(ts), "%H:%M:%S", &tm);
  const char* base = std::strrchr(file_, '/');
  base = base ? base + 1 : file_;
  std::string line = std::string(Letter(level_)) + " " + ts + "." + std::to_string(1000 + ms).substr(1) + " " +
                     base + ":" + std::to_string(line_) + "] " + os_.str() + "\n";
  static std::mutex mu;
  {
    std::lock_guard<std::mutex> lock(mu);
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
  if (level_ == Level::kFatal) std::abort();
}

}  // namespace numoe::log
