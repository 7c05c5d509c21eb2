#include "deploy/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace numoe::deploy {

Child* Supervisor::Add(Child child) {
  children_.push_back(std::make_unique<Child>(std::move(child)));
  return children_.back().get();
}

Status Supervisor::Start(Child* ch) {
  int fds[2] = {-1, -1};
  const bool notify = ch->ready_file.empty();
  if (notify && pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
  if (!ch->ready_file.empty()) std::filesystem::remove(ch->ready_file);
  std::string log_path;
  if (!c_.log_dir.empty()) log_path = c_.log_dir + "/" + ch->name + ".log";
  std::vector<std::string> argv_s = {ch->binary};
  argv_s.insert(argv_s.end(), ch->args.begin(), ch->args.end());
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork for ", ch->name, " failed"));
  if (pid == 0) {
    // Child: die with serve, keep stdout clean for serve's ready line, unblock the signals serve blocks.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (!log_path.empty()) {
      int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
      }
    }
    dup2(2, 1);
    if (notify) {
      const int w = dup(fds[1]);  // not close-on-exec
      setenv("NUMOE_NOTIFY_FD", std::to_string(w).c_str(), 1);
    } else {
      unsetenv("NUMOE_NOTIFY_FD");
    }
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv_s[0].c_str(), argv.data());
    std::fprintf(stderr, "numoe serve: cannot run %s: %s\n", argv_s[0].c_str(), std::strerror(errno));
    _exit(127);
  }
  if (notify) {
    close(fds[1]);
    ch->notify_fd = fds[0];
  }
  ch->notify_buf.clear();
  ch->pid = pid;
  ch->ready = false;
  ch->started = Clock::now();
  NLOG(INFO) << "numoe serve: started " << ch->name << " (pid " << pid << ")";
  return absl::OkStatus();
}

int Supervisor::Tick(int wait_ms, bool restart, Status* failure) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGCHLD);
  // Wait on the notify pipes and, between polls, on signals.
  std::vector<pollfd> fds;
  std::vector<Child*> owners;
  for (auto& ch : children_) {
    if (ch->notify_fd >= 0) {
      fds.push_back(pollfd{ch->notify_fd, POLLIN, 0});
      owners.push_back(ch.get());
    }
  }
  if (!fds.empty()) {
    poll(fds.data(), fds.size(), std::min(wait_ms, 50));
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents != 0) ReadNotify(owners[i]);
    }
  }
  const timespec ts{0, fds.empty() ? std::min(wait_ms, 50) * 1000000L : 0L};
  int sig = sigtimedwait(&set, nullptr, &ts);
  while (sig == SIGCHLD) sig = sigtimedwait(&set, nullptr, &ts);
  if (sig == SIGINT || sig == SIGTERM) return sig;

  for (auto& ch : children_) {
    if (!ch->ready_file.empty() && ch->pid > 0 && !ch->ready && std::filesystem::exists(ch->ready_file)) {
      MarkReady(ch.get(), "");
    }
  }
  // Reap exits.
  for (;;) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid <= 0) break;
    for (auto& ch : children_) {
      if (ch->pid != pid) continue;
      ch->pid = -1;
      if (ch->notify_fd >= 0) close(ch->notify_fd);
      ch->notify_fd = -1;
      ch->ready = false;
      const std::string how = WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                                : absl::StrCat("was killed by signal ", WTERMSIG(status));
      if (!restart || !ch->ever_ready) {
        *failure = absl::UnavailableError(absl::StrCat(ch->name, " ", how, " before it was ready",
                                                       c_.log_dir.empty() ? " (see its messages above)"
                                                                          : " (see " + c_.log_dir + "/" + ch->name + ".log)"));
        return 0;
      }
      const double up = std::chrono::duration<double>(Clock::now() - ch->started).count();
      if (up > 60) ch->backoff_s = 1.0;
      ch->restart_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(ch->backoff_s * 1000));
      NLOG(WARNING) << "numoe serve: " << ch->name << " (pid " << pid << ") " << how << " after " << up
                    << " s; restarting in " << ch->backoff_s << " s (restart #" << ch->restarts + 1 << ")";
      ch->backoff_s = std::min(ch->backoff_s * 2, 30.0);
      ++ch->restarts;
    }
  }
  // Due restarts.
  if (restart) {
    for (auto& ch : children_) {
      if (ch->pid < 0 && ch->ever_ready && Clock::now() >= ch->restart_at) {
        if (Status st = Start(ch.get()); !st.ok()) NLOG(ERROR) << "numoe serve: " << st;
      }
    }
  }
  return 0;
}

int Supervisor::WaitReady(const std::vector<Child*>& group, Status* failure) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(c_.startup_timeout_s * 1000));
  for (;;) {
    bool all = true;
    for (Child* ch : group) all = all && ch->ready;
    if (all) return 0;
    if (Clock::now() > deadline) {
      *failure = absl::DeadlineExceededError(
          absl::StrCat("not every process was ready within --startup-timeout ", c_.startup_timeout_s, " s"));
      return -1;
    }
    const int sig = Tick(100, /*restart=*/false, failure);
    if (sig != 0) return sig;
    if (!failure->ok()) return -1;
  }
}

void Supervisor::StopAll() {
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(c_.stop_timeout_s * 1000));
  for (int tier = 2; tier >= 0; --tier) {
    for (auto& ch : children_) {
      if (ch->tier == tier && ch->pid > 0) kill(ch->pid, SIGTERM);
    }
    for (;;) {
      bool left = false;
      for (auto& ch : children_) {
        if (ch->tier != tier || ch->pid <= 0) continue;
        if (waitpid(ch->pid, nullptr, WNOHANG) == ch->pid) {
          ch->pid = -1;
        } else {
          left = true;
        }
      }
      if (!left) break;
      if (Clock::now() > deadline) {
        for (auto& ch : children_) {
          if (ch->tier != tier || ch->pid <= 0) continue;
          NLOG(WARNING) << "numoe serve: " << ch->name << " did not stop within " << c_.stop_timeout_s
                        << " s; SIGKILL";
          kill(ch->pid, SIGKILL);
          waitpid(ch->pid, nullptr, 0);
          ch->pid = -1;
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  for (auto& ch : children_) {
    if (ch->notify_fd >= 0) close(ch->notify_fd);
    ch->notify_fd = -1;
    std::error_code ec;  // the router's readiness file would otherwise stay in the temp directory
    if (!ch->ready_file.empty()) std::filesystem::remove(ch->ready_file, ec);
  }
}

void Supervisor::ReadNotify(Child* ch) {
  char buf[512];
  const ssize_t n = read(ch->notify_fd, buf, sizeof(buf));
  if (n <= 0) {  // closed: either after READY (normal) or by an exiting child (reaped elsewhere)
    close(ch->notify_fd);
    ch->notify_fd = -1;
    return;
  }
  ch->notify_buf.append(buf, static_cast<size_t>(n));
  const size_t nl = ch->notify_buf.find('\n');
  if (nl != std::string::npos && ch->notify_buf.rfind("READY ", 0) == 0) {
    MarkReady(ch, ch->notify_buf.substr(6, nl - 6));
  }
}

void Supervisor::MarkReady(Child* ch, const std::string& what) {
  ch->ready = true;
  const bool again = ch->ever_ready;
  ch->ever_ready = true;
  NLOG(INFO) << "numoe serve: " << ch->name << (again ? " is back" : " is ready")
             << (what.empty() ? "" : " on " + what);
}

}  // namespace numoe::deploy
