// The process supervisor of `numoe serve`: starts child processes, waits for their readiness, restarts
// the ones that exit, and stops them all in order.
//
// Readiness: a child whose ready_file is empty gets NUMOE_NOTIFY_FD (common/process.h NotifyReady) and is
// ready when it writes "READY <text>\n" there; otherwise it is ready once ready_file exists (the router's
// --ready-file).
// Restarts: a child that exits after it was ready is restarted with exponential backoff (1 s doubling to
// 30 s, reset after a minute of uptime), logged. One that exits before it was ever ready (bad model, port
// in use) is reported, not restarted: restarting a misconfiguration forever would hide it.
// No orphans: children get PR_SET_PDEATHSIG(SIGTERM), so even a SIGKILLed supervisor takes them down.
// Signals: the caller blocks SIGINT, SIGTERM and SIGCHLD before the first Start; Tick takes them.
// Not thread-safe: one thread drives it.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace numoe::deploy {

struct SupervisorOptions {
  std::string log_dir;             // each child's stderr+stdout to log_dir/<name>.log; "" = the supervisor's stderr
  double stop_timeout_s = 15;      // StopAll: SIGKILL after this long
  double startup_timeout_s = 900;  // WaitReady: give up after this long
};

// One supervised child process.
struct Child {
  using Clock = std::chrono::steady_clock;
  std::string name;  // "numoe-gpu", "numoe-worker-0", "numoe-router"
  int tier = 0;      // stop order: higher tiers first (router 2, workers 1, numoe-gpu 0)
  std::string binary;
  std::vector<std::string> args;
  std::string ready_file;  // router: readiness = this file exists; others: NUMOE_NOTIFY_FD
  pid_t pid = -1;
  int notify_fd = -1;
  std::string notify_buf;
  bool ready = false;
  bool ever_ready = false;
  Clock::time_point started, restart_at;
  double backoff_s = 1.0;
  int restarts = 0;
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options) : c_(std::move(options)) {}
  ~Supervisor() { StopAll(); }
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Registers a child (not started); the pointer stays valid for the supervisor's life.
  Child* Add(Child child);
  // Forks and execs the child.
  Status Start(Child* ch);
  // Runs one supervision tick (up to `wait_ms`): signals, readiness, exits and due restarts.
  // Returns the shutdown signal when one arrived, else 0. `restart` false: an exit is reported in
  // `failure`, not restarted (startup phase).
  int Tick(int wait_ms, bool restart, Status* failure);
  // Waits until every child in `group` is ready. Returns the shutdown signal (>0), 0 when ready, or -1
  // with `failure` set.
  int WaitReady(const std::vector<Child*>& group, Status* failure);
  // SIGTERM tier by tier (router, then workers, then numoe-gpu), so nothing in flight loses its
  // downstream first; SIGKILL what is left at the deadline.
  void StopAll();

 private:
  using Clock = Child::Clock;
  void ReadNotify(Child* ch);
  void MarkReady(Child* ch, const std::string& what);

  const SupervisorOptions c_;
  std::vector<std::unique_ptr<Child>> children_;
};

}  // namespace numoe::deploy
