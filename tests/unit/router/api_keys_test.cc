// API keys: the constant-time compare, the key file's format and its errors, the one check REST and gRPC
// share, and which --host values count as loopback.
#include "router/core/api_keys.h"

#include <gtest/gtest.h>

#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe::router {
namespace {

TEST(ConstantTimeEquals, Correct) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("sk-abc123", "sk-abc123"));
  EXPECT_FALSE(ConstantTimeEquals("sk-abc123", "sk-abc124"));  // last byte
  EXPECT_FALSE(ConstantTimeEquals("sk-abc123", "tk-abc123"));  // first byte
  EXPECT_FALSE(ConstantTimeEquals("sk-abc123", "sk-abc12"));   // a prefix
  EXPECT_FALSE(ConstantTimeEquals("sk-abc12", "sk-abc123"));
  EXPECT_FALSE(ConstantTimeEquals("", "x"));
  EXPECT_FALSE(ConstantTimeEquals("x", ""));
  // Bytes past the shorter string compare as zero: the lengths must still decide.
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab"));
  EXPECT_TRUE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0b", 3)));
  EXPECT_FALSE(ConstantTimeEquals(std::string("a\0b", 3), std::string("a\0c", 3)));
  // Every single-bit difference at every position is seen.
  const std::string key = "0123456789abcdef";
  for (size_t i = 0; i < key.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string other = key;
      other[i] = static_cast<char>(other[i] ^ (1 << bit));
      EXPECT_FALSE(ConstantTimeEquals(key, other)) << i << " " << bit;
    }
  }
}

TEST(ApiKeyFile, Parses) {
  ASSERT_OK_AND_ASSIGN(auto keys, ParseApiKeys("# team keys\n\nsk-one\n  sk-two  \r\n\t# indented comment\nsk-three",
                                               "keys.txt"));
  EXPECT_EQ(keys, (std::vector<std::string>{"sk-one", "sk-two", "sk-three"}));
}

TEST(ApiKeyFile, ErrorsNameTheLine) {
  auto two = ParseApiKeys("sk-one\n# ok\nsk-two sk-three\n", "keys.txt");
  ASSERT_FALSE(two.ok());
  EXPECT_EQ(two.status().message(), "keys.txt:3: a key may not contain whitespace (one key per line)");
  auto binary = ParseApiKeys("sk-one\nsk-\x01two\n", "keys.txt");
  ASSERT_FALSE(binary.ok());
  EXPECT_NE(binary.status().message().find("keys.txt:2: "), std::string::npos) << binary.status();
  auto none = ParseApiKeys("# only comments\n\n", "keys.txt");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("keys.txt: no key"), std::string::npos) << none.status();
}

TEST(ApiKeyFile, Loads) {
  test::TempDir dir("api-keys");
  ASSERT_TRUE(test::WriteFile(dir / "keys", "a1\nb2\n"));
  ASSERT_OK_AND_ASSIGN(auto keys, LoadApiKeyFile(dir / "keys"));
  EXPECT_EQ(keys, (std::vector<std::string>{"a1", "b2"}));
  ASSERT_TRUE(test::WriteFile(dir / "bad", "a1\n\nb2 c3\n"));
  auto bad = LoadApiKeyFile(dir / "bad");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "--api-key-file " + (dir / "bad") + ":3: a key may not contain whitespace (one key per line)");
  auto missing = LoadApiKeyFile(dir / "nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().message(), "--api-key-file " + (dir / "nope") + ": cannot open the file");
}

TEST(ApiKeys, Check) {
  ApiKeys off;
  EXPECT_OK(off.Check("", "", "send it"));
  EXPECT_OK(off.Check("Bearer whatever", "", "send it"));

  ApiKeys keys({"k-one", "k-two"});
  EXPECT_EQ(keys.size(), 2u);
  EXPECT_TRUE(keys.Matches("k-one"));
  EXPECT_TRUE(keys.Matches("k-two"));
  EXPECT_FALSE(keys.Matches("k-thre"));
  EXPECT_FALSE(keys.Matches(""));
  EXPECT_OK(keys.Check("Bearer k-one", "", "send it"));
  EXPECT_OK(keys.Check("Bearer k-two", "", "send it"));
  EXPECT_OK(keys.Check("", "k-two", "send it"));
  EXPECT_OK(keys.Check("Bearer wrong", "k-one", "send it"));  // either header may carry it
  Status missing = keys.Check("", "", "send the header X");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(missing.message(), "missing API key: send the header X");
  for (auto [auth, x] : std::vector<std::pair<std::string, std::string>>{
           {"Bearer k-on", ""}, {"Bearer k-one ", ""}, {"k-one", ""}, {"Bearer ", ""}, {"bearer k-one", ""},
           {"Basic k-one", ""}, {"", "Bearer k-one"}, {"", "k-one\n"}}) {
    Status s = keys.Check(auth, x, "send it");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << "'" << auth << "' '" << x << "'";
    EXPECT_EQ(s.message(), "invalid API key");
  }
  // Empty keys are dropped (an empty --api-key means none).
  EXPECT_TRUE(ApiKeys({""}).empty());
}

TEST(IsLoopbackHost, Hosts) {
  for (const char* h : {"127.0.0.1", "127.1.2.3", "::1", "localhost"}) EXPECT_TRUE(IsLoopbackHost(h)) << h;
  for (const char* h : {"0.0.0.0", "::", "192.168.1.10", "10.0.0.1", "127.0.0", "1270.0.0.1", "127.0.0.1.5", ""}) {
    EXPECT_FALSE(IsLoopbackHost(h)) << h;
  }
}

}  // namespace
}  // namespace numoe::router
