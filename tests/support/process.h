// Child processes for tests: one Child class for daemons that run while the test talks to them, and
// RunCommand for commands that run to completion. Every child gets PR_SET_PDEATHSIG(SIGKILL), so a test
// that crashes leaves nothing behind.
//
// A Child's stdout and stderr go to files, not pipes: a daemon logs for as long as it runs, and a pipe the
// test does not drain would block it once 64 KiB are buffered; the files also keep the log for the failure
// message. RunCommand does use pipes (it drains both until the command exits).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace numoe::test {

// NUMOE_BIN_DIR/<name>: a binary built by this tree (numoe, numoe-gpu, numoe-worker, ...).
std::string BinPath(const std::string& name);

struct ChildOptions {
  // stdout and stderr go here (truncated, or appended with append_log); "" leaves them as the test's.
  std::string log;
  bool append_log = false;
  // stdout alone goes here (truncated): the ready line of `numoe serve`; see WaitForLine.
  std::string stdout_file;
  // The child leads a new process group (pgid == pid), so ProcessGroupMembers(pid) lists what it started.
  bool new_group = false;
  // Passes a readiness pipe as NUMOE_NOTIFY_FD (common/process.h NotifyReady); see WaitReady.
  bool notify = false;
};

// A child process, stopped (SIGTERM, then SIGKILL after 10 s) and reaped on destruction unless it has
// already exited. Move-only.
class Child {
 public:
  Child() = default;
  // Starts argv[0] (a path) with the arguments. pid() is -1 when fork failed.
  static Child Start(const std::vector<std::string>& argv, const ChildOptions& options = {});
  Child(Child&& o) noexcept;
  Child& operator=(Child&& o) noexcept;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child();

  pid_t pid() const { return pid_; }
  // Whether it is still running (reaps it when it has exited).
  bool running();
  // Sends `sig` and returns at once.
  void Signal(int sig);
  // Waits for exit up to `timeout`; returns the wait status (as from waitpid), or -1 on timeout (the
  // child keeps running). After the child was reaped it returns the status it exited with.
  int Wait(std::chrono::milliseconds timeout);
  // SIGTERM, then SIGKILL if it has not exited after `grace`; returns the wait status.
  int Terminate(std::chrono::milliseconds grace = std::chrono::seconds(10));
  // SIGKILL and reap.
  void Kill();

  // With notify: the text after "READY " on the readiness pipe (e.g. "127.0.0.1:40123"), or "" when the
  // child closed the pipe without it (it died) or `timeout` passed.
  std::string WaitReady(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // With stdout_file: the first complete line the child wrote to stdout (without the newline), or "" when
  // it exited first or `timeout` passed.
  std::string WaitForLine(std::chrono::milliseconds timeout = std::chrono::seconds(120));
  // The contents of the log file ("" without one).
  std::string Log() const;

 private:
  void Close();
  pid_t pid_ = -1;
  int status_ = -1;  // the wait status once reaped
  int notify_fd_ = -1;
  std::string log_, stdout_file_;
};

struct RunResult {
  int rc = -1;             // the exit code; -1 when it did not exit normally (killed by a signal)
  std::string out, err;    // stdout and stderr (with merge_stderr, both in `out`, in the order written)
  int64_t peak_rss_kb = 0; // the child's peak resident set size
};

struct RunOptions {
  bool merge_stderr = false;  // stderr into the stdout pipe (`2>&1`)
};

// Runs argv[0] (a path) to completion and returns what it printed.
// (Not `Run`: inside a TEST body that name is testing::Test::Run.)
RunResult RunCommand(const std::vector<std::string>& argv, const RunOptions& options = {});

// `program` followed by the words of `args`: split on whitespace, a '...' part kept whole (no escapes), as a
// shell would for the command lines tests write ("--model '/tmp/a b' --json").
std::vector<std::string> CommandLine(const std::string& program, const std::string& args);

// Processes of process group `pgid` (from /proc; zombies excluded), as (pid, command name).
std::vector<std::pair<pid_t, std::string>> ProcessGroupMembers(pid_t pgid);

// How many processes have `needle` in their command line (from /proc): 0 once a stack started with a unique
// path (a model or log directory) on its command lines is gone.
int ProcessesMentioning(const std::string& needle);

}  // namespace numoe::test
