// Minimal leveled logging to stderr (Debian's absl 20220623 has no absl/log).
//   NLOG(INFO) << "loaded " << n << " tensors";
// Levels: DEBUG < INFO < WARNING < ERROR. FATAL logs and aborts (invariants only).
// NUMOE_LOG_LEVEL=debug|info|warning|error sets the threshold (default info).
#pragma once

#include <sstream>
#include <string_view>

namespace numoe::log {

enum class Level { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };

bool Enabled(Level level);
void SetThreshold(Level level);

class Message {
 public:
  Message(Level level, const char* file, int line);
  ~Message();
  std::ostream& stream() { return os_; }

 private:
  Level level_;
  const char* file_;
  int line_;
  std::ostringstream os_;
};

// Swallows the stream when the level is disabled.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace numoe::log

#define NUMOE_LOG_LEVEL_DEBUG ::numoe::log::Level::kDebug
#define NUMOE_LOG_LEVEL_INFO ::numoe::log::Level::kInfo
#define NUMOE_LOG_LEVEL_WARNING ::numoe::log::Level::kWarning
#define NUMOE_LOG_LEVEL_ERROR ::numoe::log::Level::kError
#define NUMOE_LOG_LEVEL_FATAL ::numoe::log::Level::kFatal

#define NLOG(sev)                                            \
  !::numoe::log::Enabled(NUMOE_LOG_LEVEL_##sev)              \
      ? (void)0                                              \
      : ::numoe::log::Voidify() &                            \
            ::numoe::log::Message(NUMOE_LOG_LEVEL_##sev, __FILE__, __LINE__).stream()

// NCHECK(cond) << "why": invariant check; logs file:line and aborts. Not for input validation.
#define NCHECK(cond) \
  (cond) ? (void)0   \
         : ::numoe::log::Voidify() & ::numoe::log::Message(NUMOE_LOG_LEVEL_FATAL, __FILE__, __LINE__).stream() << "check failed: " #cond " "
