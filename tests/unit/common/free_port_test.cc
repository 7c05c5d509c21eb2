// Ports picked before daemons start (common/free_port.h): below the ephemeral range, bindable, never handed
// out twice within the reservation window (in this process or another one sharing the registry), and a port
// something listens on is never handed out.
#include "common/free_port.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <ctime>
#include <fstream>
#include <set>
#include <string>

#include "tests/support/files.h"

namespace numoe {
namespace {

int FirstEphemeralPort() {
  int lo = 32768, hi = 60999;
  std::ifstream f("/proc/sys/net/ipv4/ip_local_port_range");
  if (f) f >> lo >> hi;
  return lo;
}

bool Binds(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

// Each test gets its own registry (TMPDIR), so what it counts is its own.
class FreePortTest : public ::testing::Test {
 protected:
  void SetUp() override { setenv("TMPDIR", dir_.str().c_str(), 1); }
  void TearDown() override { unsetenv("TMPDIR"); }
  test::TempDir dir_{"free-port"};
};

TEST_F(FreePortTest, PortsAreBindableBelowTheEphemeralRangeAndNeverRepeat) {
  std::set<int> seen;
  for (int i = 0; i < 200; ++i) {
    StatusOr<int> p = ReserveLocalPort();
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_GE(*p, 10000);
    EXPECT_LT(*p, FirstEphemeralPort());
    EXPECT_TRUE(Binds(*p)) << *p;
    EXPECT_TRUE(seen.insert(*p).second) << "port " << *p << " handed out twice";
  }
  // The registry lists every one of them.
  std::ifstream f(dir_.path() / ("numoe-ports-" + std::to_string(getuid())));
  int port = 0;
  long when = 0;
  std::set<int> listed;
  while (f >> port >> when) listed.insert(port);
  EXPECT_EQ(listed, seen);
}

TEST_F(FreePortTest, ConsecutivePortsAllBind) {
  StatusOr<int> first = ReserveLocalPorts(4);
  ASSERT_TRUE(first.ok()) << first.status();
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(Binds(*first + i)) << *first + i;
  EXPECT_LT(*first + 3, FirstEphemeralPort());
  EXPECT_FALSE(ReserveLocalPorts(0).ok());
}

// Another process with the same registry never gets this one's ports.
TEST_F(FreePortTest, ProcessesSharingTheRegistryGetDistinctPorts) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    for (int i = 0; i < 100; ++i) {
      StatusOr<int> p = ReserveLocalPort();
      const int v = p.ok() ? *p : -1;
      if (write(fds[1], &v, sizeof(v)) != sizeof(v)) _exit(2);
    }
    _exit(0);
  }
  close(fds[1]);
  std::set<int> mine;
  for (int i = 0; i < 100; ++i) {
    StatusOr<int> p = ReserveLocalPort();
    ASSERT_TRUE(p.ok()) << p.status();
    mine.insert(*p);
  }
  int v = 0, theirs = 0;
  while (read(fds[0], &v, sizeof(v)) == sizeof(v)) {
    ++theirs;
    ASSERT_GT(v, 0);
    EXPECT_EQ(mine.count(v), 0u) << "port " << v << " handed to both processes";
  }
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(theirs, 100);
  EXPECT_EQ(mine.size(), 100u);
}

// A port something listens on is not handed out. The registry is filled with every choosable port but two,
// P and P + 1, and something listens on P: the picker must hand out P + 1, then report that none is left.
TEST_F(FreePortTest, AListeningPortIsSkippedAndExhaustionIsAnError) {
  StatusOr<int> p = ReserveLocalPorts(2);
  ASSERT_TRUE(p.ok()) << p.status();
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(*p));
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  {
    std::ofstream f(dir_.path() / ("numoe-ports-" + std::to_string(getuid())), std::ios::trunc);
    const long now = static_cast<long>(time(nullptr));
    for (int port = 10000; port < FirstEphemeralPort(); ++port) {
      if (port != *p && port != *p + 1) f << port << " " << now << "\n";
    }
  }
  StatusOr<int> q = ReserveLocalPort();
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*q, *p + 1);
  StatusOr<int> none = ReserveLocalPort();
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted) << none.status();
  close(fd);
}

}  // namespace
}  // namespace numoe
