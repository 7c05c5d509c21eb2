// Runs a binary as a child process for the mkmodel tests: exit code, stdout+stderr, peak RSS.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace numoe::test {

struct RunResult {
  int exit_code = -1;   // -1: did not exit normally
  std::string output;   // stdout and stderr, interleaved
  int64_t max_rss_kb = 0;
};

inline RunResult RunProcess(const std::vector<std::string>& args) {
  RunResult r;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return r;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::perror("execv");
    ::_exit(127);
  }
  ::close(fds[1]);
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof(buf))) > 0) r.output.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  struct rusage ru{};
  if (::wait4(pid, &status, 0, &ru) == pid && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  r.max_rss_kb = ru.ru_maxrss;
  return r;
}

inline std::string NumoeBin() { return std::string(NUMOE_BIN_DIR) + "/numoe"; }

inline std::string ReadFile(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// FNV-1a 64 of a file's bytes (what the determinism tests compare and print).
inline uint64_t HashFile(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  uint64_t h = 1469598103934665603ull;
  char buf[1 << 16];
  while (f.read(buf, sizeof(buf)) || f.gcount() > 0) {
    for (std::streamsize i = 0; i < f.gcount(); ++i) h = (h ^ static_cast<unsigned char>(buf[i])) * 1099511628211ull;
  }
  return h;
}

// A fresh empty directory under the test's temp dir, removed by the destructor.
class TempDir {
 public:
  explicit TempDir(const std::string& name) {
    const char* base = std::getenv("TMPDIR");
    path_ = std::filesystem::path(base ? base : "/tmp") / (name + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace numoe::test
