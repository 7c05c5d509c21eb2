#include "common/process.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>

namespace numoe {
void NotifyReady(const std::string& text) {
  const char* env = std::getenv("NUMOE_NOTIFY_FD");
  if (env == nullptr) return;
  char* end = nullptr;
  const long fd = std::strtol(env, &end, 10);
  if (end == env || fd < 0) return;
  const std::string line = "READY " + text + "\n";
  ssize_t unused = write(static_cast<int>(fd), line.data(), line.size());
  (void)unused;
  close(static_cast<int>(fd));
  unsetenv("NUMOE_NOTIFY_FD");
}

void BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal(const std::function<bool()>& give_up, int poll_ms) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  const timespec ts{poll_ms / 1000, (poll_ms % 1000) * 1000000L};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
    if (give_up && give_up()) return 0;
  }
}

}  // namespace numoe
