#include "common/free_port.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace numoe {
namespace {

// The lowest port handed out: below it live well-known services.
constexpr int kLowestPort = 10000;

// Whether `port` binds on every address now, without SO_REUSEADDR (so a TIME_WAIT connection on it counts
// as taken: a daemon that binds without the option would fail there).
bool Binds(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

// The ports the kernel never picks on its own: [kLowestPort, first ephemeral port).
std::pair<int, int> ChoosableRange() {
  int lo = 32768, hi = 60999;
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  if (f) f >> lo >> hi;
  return {kLowestPort, lo};
}

// The registry: "port unix_seconds" per line, under an exclusive flock for the whole pick.
class Registry {
 public:
  Registry() {
    const char* tmp = std::getenv("TMPDIR");
    const std::string path =
        absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/numoe-ports-", ::getuid());
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0) {
      ::close(fd_);
      fd_ = -1;
    }
    if (fd_ < 0) return;  // no registry: the bind check alone
    std::string text;
    char buf[4096];
    for (ssize_t n; (n = ::pread(fd_, buf, sizeof(buf), static_cast<off_t>(text.size()))) > 0;) text.append(buf, n);
    const long now = static_cast<long>(std::time(nullptr));
    std::istringstream in(text);
    int port = 0;
    long when = 0;
    while (in >> port >> when) {
      if (now - when < kReservedSeconds && when <= now) given_[port] = when;
    }
  }
  ~Registry() {
    if (fd_ < 0) return;
    std::string text;
    for (const auto& [port, when] : given_) absl::StrAppend(&text, port, " ", when, "\n");
    if (::ftruncate(fd_, 0) == 0) {
      for (size_t off = 0; off < text.size();) {
        const ssize_t n = ::pwrite(fd_, text.data() + off, text.size() - off, static_cast<off_t>(off));
        if (n <= 0) break;
        off += static_cast<size_t>(n);
      }
    }
    ::close(fd_);  // releases the lock
  }
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  bool Given(int port) const { return given_.count(port) != 0; }
  void Give(int port) { given_[port] = static_cast<long>(std::time(nullptr)); }

 private:
  int fd_ = -1;
  std::map<int, long> given_;
};

}  // namespace

StatusOr<int> ReserveLocalPorts(int n) {
  if (n < 1) return absl::InvalidArgumentError(absl::StrCat("cannot reserve ", n, " ports"));
  const auto [lo, hi] = ChoosableRange();
  const int span = hi - lo - n + 1;
  if (span < 1) {
    return absl::ResourceExhaustedError(absl::StrCat("no ports below the ephemeral range (it starts at ", hi,
                                                     "; see /proc/sys/net/ipv4/ip_local_port_range)"));
  }
  Registry registry;
  std::random_device rd;
  const int start = static_cast<int>(std::uniform_int_distribution<int>(0, span - 1)(rd));
  for (int k = 0; k < span; ++k) {
    const int first = lo + (start + k) % span;
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) ok = !registry.Given(first + i) && Binds(first + i);
    if (!ok) continue;
    for (int i = 0; i < n; ++i) registry.Give(first + i);
    return first;
  }
  return absl::ResourceExhaustedError(absl::StrCat("no ", n, " free consecutive ports in [", lo, ", ", hi, ")"));
}

StatusOr<int> ReserveLocalPort() { return ReserveLocalPorts(1); }

}  // namespace numoe
