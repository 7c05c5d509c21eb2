#include "tests/support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <thread>

#include "tests/support/files.h"

namespace numoe::test {
namespace {

using Clock = std::chrono::steady_clock;

// In the forked child, before exec: die with the test, and never outlive a parent that already died.
void DieWithParent(pid_t parent) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
}

[[noreturn]] void Exec(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  execv(args[0], args.data());
  std::perror(("execv " + argv[0]).c_str());
  _exit(127);
}

void RedirectTo(const std::string& path, int flags, std::initializer_list<int> fds) {
  const int f = open(path.c_str(), O_WRONLY | O_CREAT | flags, 0644);
  if (f < 0) return;
  for (int fd : fds) dup2(f, fd);
  close(f);
}

}  // namespace

std::string BinPath(const std::string& name) { return std::string(NUMOE_BIN_DIR) + "/" + name; }

Child Child::Start(const std::vector<std::string>& argv, const ChildOptions& options) {
  Child c;
  int notify[2] = {-1, -1};
  if (options.notify && pipe2(notify, O_CLOEXEC) != 0) return c;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    DieWithParent(parent);
    if (options.new_group) setpgid(0, 0);
    if (!options.log.empty()) RedirectTo(options.log, options.append_log ? O_APPEND : O_TRUNC, {1, 2});
    if (!options.stdout_file.empty()) RedirectTo(options.stdout_file, O_TRUNC, {1});
    if (options.notify) {
      const int w = dup(notify[1]);  // a copy without O_CLOEXEC survives exec
      setenv("NUMOE_NOTIFY_FD", std::to_string(w).c_str(), 1);
    }
    Exec(argv);
  }
  if (options.notify) {
    close(notify[1]);
    c.notify_fd_ = notify[0];
  }
  c.pid_ = pid;
  c.log_ = options.log;
  c.stdout_file_ = options.stdout_file;
  return c;
}

Child::Child(Child&& o) noexcept
    : pid_(o.pid_), status_(o.status_), notify_fd_(o.notify_fd_), log_(std::move(o.log_)),
      stdout_file_(std::move(o.stdout_file_)) {
  o.pid_ = -1;
  o.notify_fd_ = -1;
}

Child& Child::operator=(Child&& o) noexcept {
  if (this != &o) {
    Close();
    pid_ = o.pid_;
    status_ = o.status_;
    notify_fd_ = o.notify_fd_;
    log_ = std::move(o.log_);
    stdout_file_ = std::move(o.stdout_file_);
    o.pid_ = -1;
    o.notify_fd_ = -1;
  }
  return *this;
}

Child::~Child() { Close(); }

void Child::Close() {
  if (pid_ > 0) Terminate();
  if (notify_fd_ >= 0) close(notify_fd_);
  notify_fd_ = -1;
}

bool Child::running() {
  if (pid_ <= 0) return false;
  if (waitpid(pid_, &status_, WNOHANG) == pid_) {
    pid_ = -1;
    return false;
  }
  return true;
}

void Child::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

int Child::Wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return status_;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (waitpid(pid_, &status_, WNOHANG) == pid_) {
      pid_ = -1;
      return status_;
    }
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int Child::Terminate(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return status_;
  Signal(SIGTERM);
  if (Wait(grace) != -1) return status_;
  Kill();
  return status_;
}

void Child::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, &status_, 0);
  pid_ = -1;
}

std::string Child::WaitReady(std::chrono::milliseconds timeout) {
  if (notify_fd_ < 0) return "";
  std::string line;
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
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

std::string Child::WaitForLine(std::chrono::milliseconds timeout) {
  if (stdout_file_.empty()) return "";
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    // Read before checking running(): a child that printed its line and exited still counts.
    const std::string out = ReadFile(stdout_file_);
    const size_t nl = out.find('\n');
    if (nl != std::string::npos) return out.substr(0, nl);
    if (!running()) return "";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return "";
}

std::string Child::Log() const { return log_.empty() ? "" : ReadFile(log_); }

RunResult RunCommand(const std::vector<std::string>& argv, const RunOptions& options) {
  RunResult r;
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return r;
  if (pipe2(err, O_CLOEXEC) != 0) {
    close(out[0]);
    close(out[1]);
    return r;
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    DieWithParent(parent);
    dup2(out[1], 1);
    dup2(options.merge_stderr ? out[1] : err[1], 2);
    Exec(argv);
  }
  close(out[1]);
  close(err[1]);
  // Drain both pipes until both close, so neither can fill up and block the child.
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  std::string* dst[2] = {&r.out, &r.err};
  int open_fds = 2;
  while (open_fds > 0) {
    if (poll(fds, 2, -1) < 0) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[65536];
      const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        dst[i]->append(buf, static_cast<size_t>(n));
      } else {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) close(p.fd);
  }
  int status = 0;
  struct rusage ru {};
  if (wait4(pid, &status, 0, &ru) == pid && WIFEXITED(status)) r.rc = WEXITSTATUS(status);
  r.peak_rss_kb = ru.ru_maxrss;
  return r;
}

std::vector<std::string> CommandLine(const std::string& program, const std::string& args) {
  std::vector<std::string> argv = {program};
  std::string word;
  bool in_word = false, quoted = false;
  for (const char c : args) {
    if (c == '\'') {
      quoted = !quoted;
      in_word = true;
    } else if (!quoted && std::isspace(static_cast<unsigned char>(c))) {
      if (in_word) argv.push_back(word);
      word.clear();
      in_word = false;
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) argv.push_back(word);
  return argv;
}

std::vector<std::pair<pid_t, std::string>> ProcessGroupMembers(pid_t pgid) {
  std::vector<std::pair<pid_t, std::string>> members;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    // /proc/<pid>/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
    const std::string stat = ReadFile(e.path().string() + "/stat");
    const size_t open_paren = stat.find('('), close_paren = stat.rfind(')');
    if (open_paren == std::string::npos || close_paren == std::string::npos) continue;
    std::istringstream rest(stat.substr(close_paren + 2));
    std::string state;
    long ppid = 0, pgrp = 0;
    rest >> state >> ppid >> pgrp;
    if (state == "Z") continue;  // exited, waiting to be reaped
    if (pgrp == pgid) {
      members.emplace_back(static_cast<pid_t>(std::stol(name)),
                           stat.substr(open_paren + 1, close_paren - open_paren - 1));
    }
  }
  return members;
}

int ProcessesMentioning(const std::string& needle) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::string cmd = ReadFile(e.path() / "cmdline");
    for (char& c : cmd) {
      if (c == '\0') c = ' ';
    }
    n += cmd.find(needle) != std::string::npos;
  }
  return n;
}

}  // namespace numoe::test
