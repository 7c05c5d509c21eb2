// numoe mkmodel --drafter mtp writes a preview-Flash layout checkpoint (one mtp.0 block, no DSpark config)
// that numoe inspect and numoe generate --spec mtp accept; generate's --spec default picks the checkpoint's
// drafter, speculation does not change the greedy text, and the wrong drafter is refused naming the flag.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cctype>
#include <string>
#include <vector>

#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/process.h"

namespace numoe::test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The output without log lines ("I 18:34:48.795 file.cc:69] ..."): what --quiet leaves is the text.
std::string Text(const std::string& out) {
  std::string text;
  size_t at = 0;
  while (at < out.size()) {
    size_t end = out.find('\n', at);
    end = end == std::string::npos ? out.size() : end + 1;
    const std::string line = out.substr(at, end - at);
    const bool log = line.size() > 3 && std::string("IWE").find(line[0]) != std::string::npos && line[1] == ' ' &&
                     std::isdigit(static_cast<unsigned char>(line[2]));
    if (!log) text += line;
    at = end;
  }
  return text;
}

RunResult Numoe(std::vector<std::string> args) {
  args.insert(args.begin(), BinPath("numoe"));
  return RunCommand(args, {.merge_stderr = true});
}

TEST(MtpCliTest, MkmodelInspectGenerate) {
  TempDir d("mtp-cli");
  const std::string out = d.str() + "/m";
  RunResult mk = Numoe({"mkmodel", "--preset", "tiny", "--drafter", "mtp", "--out", out, "--threads", "1"});
  ASSERT_EQ(mk.rc, 0) << mk.out;
  EXPECT_THAT(mk.out, HasSubstr("drafter mtp (1 block)"));
  EXPECT_THAT(mk.out, HasSubstr("it loads as a checkpoint"));

  RunResult in = Numoe({"inspect", "--model", out});
  ASSERT_EQ(in.rc, 0) << in.out;
  EXPECT_THAT(in.out, HasSubstr("MTP stages: 1"));
  EXPECT_THAT(in.out, Not(HasSubstr("DSpark")));

  const std::vector<std::string> gen = {"generate", "--model", out, "--prompt-ids", "5,17,99,5,17,99,3",
                                        "--max-new-tokens", "16", "--ignore-eos", "--threads", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = gen;
    a.insert(a.end(), extra.begin(), extra.end());
    return Numoe(a);
  };
  RunResult plain = with({"--spec", "none", "--quiet"});
  ASSERT_EQ(plain.rc, 0) << plain.out;
  ASSERT_GT(Text(plain.out).size(), 1u) << plain.out;
  for (const char* depth : {"1", "3", "7"}) {
    RunResult spec = with({"--spec", "mtp", "--spec-depth", depth, "--quiet"});
    ASSERT_EQ(spec.rc, 0) << spec.out;
    EXPECT_EQ(Text(spec.out), Text(plain.out)) << "depth " << depth;
  }
  // Default: the checkpoint's drafter (mtp, depth 5 as numoe serve's), on both expert backends.
  for (const char* experts : {"kernels", "reference"}) {
    RunResult def = with({"--experts", experts});
    ASSERT_EQ(def.rc, 0) << def.out;
    EXPECT_THAT(def.out, HasSubstr("spec mtp depth 5:")) << experts;
  }
  RunResult dspark = with({"--spec", "dspark"});
  EXPECT_EQ(dspark.rc, 1);
  // The one --spec policy's message (model/spec_policy.h), as numoe serve prints it.
  EXPECT_THAT(dspark.out, HasSubstr("--spec dspark: " + out + " has a mtp drafter"));
  EXPECT_THAT(dspark.out, HasSubstr("use --spec mtp, ngram or none"));

  // The DSpark fixture has no MTP block.
  RunResult fixture = Numoe({"generate", "--model", TinyDir(), "--prompt-ids", "5,6", "--spec", "mtp"});
  EXPECT_EQ(fixture.rc, 1);
  EXPECT_THAT(fixture.out, HasSubstr("--spec mtp: " + TinyDir() + " has a dspark drafter"));
  EXPECT_THAT(fixture.out, HasSubstr("use --spec dspark, ngram or none"));
}

TEST(MtpCliTest, MkmodelDrafterFlagErrors) {
  TempDir d("mtp-cli-flags");
  const std::string out = d.str() + "/m";
  RunResult bad = Numoe({"mkmodel", "--preset", "tiny", "--drafter", "eagle", "--out", out});
  EXPECT_EQ(bad.rc, 1);
  EXPECT_THAT(bad.out, HasSubstr("--drafter must be none, mtp or dspark"));
  RunResult both = Numoe({"mkmodel", "--preset", "tiny", "--drafter", "mtp", "--dspark-stages", "2", "--out", out});
  EXPECT_EQ(both.rc, 1);
  EXPECT_THAT(both.out, HasSubstr("--dspark-stages 2 needs --drafter dspark"));
  RunResult none = Numoe({"mkmodel", "--preset", "tiny", "--drafter", "none", "--out", out, "--dry-run"});
  EXPECT_EQ(none.rc, 0) << none.out;
  EXPECT_THAT(none.out, HasSubstr("drafter none"));
  RunResult flash = Numoe({"mkmodel", "--preset", "v4-flash", "--drafter", "dspark", "--out", out, "--dry-run"});
  EXPECT_EQ(flash.rc, 0) << flash.out;
  EXPECT_THAT(flash.out, HasSubstr("drafter dspark (3 stages)"));
}

}  // namespace
}  // namespace numoe::test
