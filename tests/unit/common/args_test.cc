#include "common/args.h"
#include "tests/support/status_matchers.h"

#include <gtest/gtest.h>

namespace numoe {
namespace {

Status ParseVec(ArgParser& p, std::vector<std::string> args) {
  std::vector<char*> argv = {const_cast<char*>("prog")};
  for (auto& a : args) argv.push_back(a.data());
  return p.Parse(static_cast<int>(argv.size()), argv.data());
}

TEST(ArgParser, ParsesAllKinds) {
  ArgParser p("prog", "test");
  bool flag = false;
  std::string s;
  int64_t i = 3;
  double d = 0.5;
  p.AddFlag("json", "json", &flag);
  p.AddString("model", "DIR", "model", &s, true);
  p.AddInt("n", "N", "n", &i, 0, 10);
  p.AddDouble("t", "T", "t", &d, 0.0, 2.0);
  ASSERT_OK(ParseVec(p, {"--json", "--model", "x", "--n=7", "--t", "1.5"}));
  EXPECT_TRUE(flag);
  EXPECT_EQ(s, "x");
  EXPECT_EQ(i, 7);
  EXPECT_DOUBLE_EQ(d, 1.5);
  EXPECT_TRUE(p.given("n"));
}

TEST(ArgParser, ErrorsNameTheFlag) {
  ArgParser p("prog", "test");
  std::string s;
  int64_t i = 0;
  p.AddString("model", "DIR", "model", &s, true);
  p.AddInt("n", "N", "n", &i, 0, 10);
  Status st = ParseVec(p, {"--model", "m", "--n", "-1"});
  EXPECT_NE(st.message().find("--n"), std::string::npos) << st;
  st = ParseVec(p, {"--model", "m", "--n", "abc"});
  EXPECT_NE(st.message().find("not an integer"), std::string::npos) << st;
  st = ParseVec(p, {"--bogus"});
  EXPECT_NE(st.message().find("unknown flag --bogus"), std::string::npos) << st;
  ArgParser q("prog", "test");
  q.AddString("model", "DIR", "model", &s, true);
  st = ParseVec(q, {});
  EXPECT_NE(st.message().find("--model is required"), std::string::npos) << st;
  st = ParseVec(q, {"--model"});
  EXPECT_NE(st.message().find("needs a value"), std::string::npos) << st;
}

TEST(ArgParser, IntList) {
  auto v = ParseIntList("1,2,30", "--prompt-ids");
  ASSERT_OK(v);
  EXPECT_EQ(*v, (std::vector<int64_t>{1, 2, 30}));
  EXPECT_FALSE(ParseIntList("1,,2", "--prompt-ids").ok());
  EXPECT_FALSE(ParseIntList("", "--prompt-ids").ok());
}

}  // namespace
}  // namespace numoe
