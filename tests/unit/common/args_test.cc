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

TEST(ArgParser, EnumsParseByNameWithOneMessage) {
  ArgParser p("prog", "test");
  Backend b = Backend::kCpu;
  p.AddEnum("backend", "backend", &b);
  ASSERT_TRUE(ParseVec(p, {"--backend", "cuda"}).ok());
  EXPECT_EQ(b, Backend::kCuda);
  EXPECT_EQ(ParseVec(p, {"--backend=tpu"}).message(), "--backend must be auto, cpu or cuda (got 'tpu')");
  EXPECT_NE(p.Help().find("--backend auto|cpu|cuda"), std::string::npos) << p.Help();
  EXPECT_NE(p.Help().find("(default: cpu)"), std::string::npos) << p.Help();
}

TEST(ArgParser, IntOverloadsKeepTheirTypesRanges) {
  ArgParser p("prog", "test");
  int port = 8000;
  size_t bytes = 0;
  p.AddInt("port", "N", "port", &port, 0, 65535);
  p.AddInt("bytes", "N", "bytes", &bytes, 1, int64_t{1} << 40);
  ASSERT_TRUE(ParseVec(p, {"--port", "9", "--bytes", "1099511627776"}).ok());
  EXPECT_EQ(port, 9);
  EXPECT_EQ(bytes, size_t{1} << 40);
  EXPECT_NE(ParseVec(p, {"--port", "70000"}).message().find("--port: 70000 is out of range [0, 65535]"),
            std::string::npos);
  EXPECT_FALSE(ParseVec(p, {"--bytes", "0"}).ok());
}

// ChangedArgv writes back exactly the options that differ from their values when added, and parsing it
// on fresh defaults restores them (doubles to the last bit).
TEST(ArgParser, ChangedArgvRoundTrips) {
  struct Values {
    std::string s;
    int64_t i = 3;
    double d = 0.5;
    bool f = false;
    std::vector<int> list;
    SpecChoice spec = SpecChoice::kAuto;
  };
  auto add = [](ArgParser& p, Values* v) {
    p.AddString("s", "S", "s", &v->s);
    p.AddInt("i", "N", "i", &v->i);
    p.AddDouble("d", "D", "d", &v->d);
    p.AddFlag("f", "f", &v->f);
    p.AddIntList("list", "L", "list", &v->list);
    p.AddEnum("spec", "spec", &v->spec);
  };
  Values v;
  ArgParser writer("prog", "");
  add(writer, &v);
  EXPECT_TRUE(writer.ChangedArgv().empty());
  v.s = "a b";
  v.d = 0.1 + 0.2;
  v.f = true;
  v.list = {4, 0, 7};
  v.spec = SpecChoice::kNgram;
  std::vector<std::string> argv = writer.ChangedArgv();
  EXPECT_EQ(argv, (std::vector<std::string>{"--s", "a b", "--d", "0.30000000000000004", "--f", "--list", "4,0,7",
                                            "--spec", "ngram"}));
  Values back;
  ArgParser reader("prog", "");
  add(reader, &back);
  ASSERT_TRUE(ParseVec(reader, argv).ok());
  EXPECT_EQ(back.s, v.s);
  EXPECT_EQ(back.i, 3);
  EXPECT_EQ(back.d, v.d);
  EXPECT_TRUE(back.f);
  EXPECT_EQ(back.list, v.list);
  EXPECT_EQ(back.spec, SpecChoice::kNgram);
  EXPECT_NE(ParseVec(reader, {"--list", "1,-2"}).message().find("--list: -2 is out of range"), std::string::npos);
}

}  // namespace
}  // namespace numoe
