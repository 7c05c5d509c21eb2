// Child processes for the integration tests: spawn a numoe binary with a readiness pipe
// (NUMOE_NOTIFY_FD, the protocol `numoe serve` uses), wait for its "READY <addr>" line, stop it.
// Children get PR_SET_PDEATHSIG so a crashed test leaves nothing behind.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace numoe::test {

class Child {
 public:
  // Starts `binary` (a file in NUMOE_BIN_DIR) with `args`; stderr (and stdout, unless `stdout_path` is
  // given) go to `log_path`. `new_group`: the child leads a new process group (pgid = its pid).
  Child(const std::string& binary, const std::vector<std::string>& args, const std::string& log_path,
        bool notify = true, bool new_group = false, const std::string& stdout_path = "") {
    int fds[2] = {-1, -1};
    if (notify && pipe2(fds, O_CLOEXEC) != 0) return;
    const std::string path = std::string(NUMOE_BIN_DIR) + "/" + binary;
    std::vector<std::string> argv_s = {path};
    argv_s.insert(argv_s.end(), args.begin(), args.end());
    const pid_t parent = getpid();
    pid_ = fork();
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      if (new_group) setpgid(0, 0);
      int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (log >= 0) {
        dup2(log, 1);
        dup2(log, 2);
      }
      if (!stdout_path.empty()) {
        int out = open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (out >= 0) dup2(out, 1);
      }
      if (notify) {
        int w = dup(fds[1]);  // without O_CLOEXEC
        setenv("NUMOE_NOTIFY_FD", std::to_string(w).c_str(), 1);
      }
      std::vector<char*> argv;
      for (auto& a : argv_s) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(path.c_str(), argv.data());
      _exit(127);
    }
    if (notify) {
      close(fds[1]);
      notify_fd_ = fds[0];
    }
    log_path_ = log_path;
  }
  ~Child() {
    Stop();
    if (notify_fd_ >= 0) close(notify_fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }

  // The text after "READY " (e.g. "127.0.0.1:40123"), or "" if the child exited or timed out.
  std::string WaitReady(int timeout_ms = 60000) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{notify_fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[256];
      const ssize_t n = read(notify_fd_, buf, sizeof(buf));
      if (n <= 0) return "";  // closed without READY: the child died
      line.append(buf, static_cast<size_t>(n));
      const size_t nl = line.find('\n');
      if (nl != std::string::npos) {
        line.resize(nl);
        return line.rfind("READY ", 0) == 0 ? line.substr(6) : "";
      }
    }
    return "";
  }

  // Sends `sig`; with wait, reaps the child (SIGKILL after 10 s). Returns the wait status.
  int Signal(int sig, bool wait = true) {
    if (pid_ <= 0) return status_;
    kill(pid_, sig);
    if (!wait) return 0;
    return Reap(10000);
  }
  int Reap(int timeout_ms) {
    if (pid_ <= 0) return status_;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const pid_t r = waitpid(pid_, &status_, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status_;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        kill(pid_, SIGKILL);
        waitpid(pid_, &status_, 0);
        pid_ = -1;
        return status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  void Stop() {
    if (pid_ > 0) Signal(SIGTERM);
  }
  bool running() {
    if (pid_ <= 0) return false;
    const pid_t r = waitpid(pid_, &status_, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return false;
    }
    return true;
  }
  std::string Log() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  pid_t pid_ = -1;
  int notify_fd_ = -1;
  int status_ = 0;
  std::string log_path_;
};

inline std::string TempPath(const std::string& name) {
  return std::string(::testing::TempDir()) + "/numoe_it_" + std::to_string(getpid()) + "_" + name;
}

}  // namespace numoe::test
