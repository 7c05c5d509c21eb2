// numoe mkmodel on the tiny preset: same seed -> identical files (any thread count), other seed -> other
// weights; the fixture's exact tensor layout and tokenizer; --out and flag validation.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/safetensors.h"
#include "common/tokenizer/tokenizer.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kData = NUMOE_TEST_DATA;

// ---- the CLI, tiny preset ---------------------------------------------------------------------------------

// FNV-1a 64 of a file's bytes (what the determinism test compares and prints).
uint64_t HashFile(const fs::path& p) {
  uint64_t h = 1469598103934665603ull;
  for (const char c : ReadFile(p)) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

std::map<std::string, uint64_t> Hashes(const fs::path& dir) {
  std::map<std::string, uint64_t> h;
  for (const auto& e : fs::directory_iterator(dir)) h[e.path().filename().string()] = HashFile(e.path());
  return h;
}

TEST(MkmodelCliTest, SameSeedSameBytesOtherSeedOtherWeights) {
  TempDir a("mk-cli-a"), b("mk-cli-b"), c("mk-cli-c");
  auto run = [](const TempDir& d, const char* seed, const char* threads) {
    return RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--seed", seed, "--threads", threads, "--out",
                       d.str() + "/m"},
                      {.merge_stderr = true});
  };
  RunResult ra = run(a, "5", "1"), rb = run(b, "5", "2"), rc = run(c, "6", "2");
  ASSERT_EQ(ra.rc, 0) << ra.out;
  ASSERT_EQ(rb.rc, 0) << rb.out;
  ASSERT_EQ(rc.rc, 0) << rc.out;
  const auto ha = Hashes(a.path() / "m"), hb = Hashes(b.path() / "m"), hc = Hashes(c.path() / "m");
  const std::set<std::string> files = {"config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                       "tokenizer.json", "tokenizer_config.json"};
  std::set<std::string> names;
  for (const auto& [n, h] : ha) names.insert(n);
  EXPECT_EQ(names, files);
  for (const auto& [name, hash] : ha) {
    SCOPED_TRACE(name + " " + std::to_string(hash));
    EXPECT_EQ(hb.at(name), hash);  // same seed, other thread count: identical
    if (name.find(".safetensors") != std::string::npos && name.find("index") == std::string::npos) {
      EXPECT_NE(hc.at(name), hash);  // other seed: other weights
    } else {
      EXPECT_EQ(hc.at(name), hash);  // config, index, tokenizer do not depend on the seed
    }
  }
}

TEST(MkmodelCliTest, TinyPresetHasTheFixturesExactLayout) {
  TempDir d("mk-cli-layout");
  RunResult r = RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--out", d.str()}, {.merge_stderr = true});
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("it loads as a checkpoint"));
  auto ours = TensorStore::Open(d.str());
  auto fixture = TensorStore::Open(kData + "/tiny-v4");
  ASSERT_OK(ours);
  ASSERT_OK(fixture);
  ASSERT_EQ((*ours)->Names(), (*fixture)->Names());
  for (const std::string& name : (*fixture)->Names()) {
    const TensorView *a = (*ours)->Find(name), *b = (*fixture)->Find(name);
    EXPECT_EQ(a->dtype, b->dtype) << name;
    EXPECT_EQ(a->shape, b->shape) << name;
  }
  auto config = LoadModelConfig(d.str());
  auto fixture_config = LoadModelConfig(kData + "/tiny-v4");
  ASSERT_OK(config);
  ASSERT_OK(fixture_config);
  EXPECT_EQ(ModelConfigToJson(*config), ModelConfigToJson(*fixture_config));
  EXPECT_EQ(ReadFile(d.path() / "tokenizer.json"), ReadFile(kData + "/tiny-v4/tokenizer.json"));
  EXPECT_EQ(ReadFile(d.path() / "tokenizer_config.json"), ReadFile(kData + "/tiny-v4/tokenizer_config.json"));
  EXPECT_OK(tokenizer::Tokenizer::Load(d.str()));
}

TEST(MkmodelCliTest, OutMustBeEmptyUnlessForce) {
  TempDir d("mk-cli-force");
  ASSERT_EQ(
      RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--out", d.str(), "--quiet"}, {.merge_stderr = true})
          .rc,
      0);
  RunResult again =
      RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--out", d.str()}, {.merge_stderr = true});
  EXPECT_EQ(again.rc, 1);
  EXPECT_THAT(again.out, HasSubstr("is not empty"));
  EXPECT_THAT(again.out, HasSubstr("--force"));

  // --force replaces the checkpoint, including shards of another shard count.
  RunResult forced =
      RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--shards", "3", "--force", "--out", d.str()},
                 {.merge_stderr = true});
  ASSERT_EQ(forced.rc, 0) << forced.out;
  EXPECT_FALSE(fs::exists(d.path() / "model-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(d.path() / "model-00003-of-00003.safetensors"));
  EXPECT_OK(Checkpoint::Open(d.str()));

  // ... but never deletes files that are not a checkpoint's.
  { std::ofstream(d.path() / "notes.txt") << "mine"; }
  RunResult foreign = RunCommand({BinPath("numoe"), "mkmodel", "--preset", "tiny", "--force", "--out", d.str()},
                                 {.merge_stderr = true});
  EXPECT_EQ(foreign.rc, 1);
  EXPECT_THAT(foreign.out, HasSubstr("notes.txt"));
  EXPECT_TRUE(fs::exists(d.path() / "model-00003-of-00003.safetensors"));

  { std::ofstream(d.path() / "file") << "x"; }
  RunResult not_dir = RunCommand(
      {BinPath("numoe"), "mkmodel", "--preset", "tiny", "--out", (d.path() / "file").string()}, {.merge_stderr = true});
  EXPECT_EQ(not_dir.rc, 1);
  EXPECT_THAT(not_dir.out, HasSubstr("is not a directory"));
}

TEST(MkmodelCliTest, BadFlagsAreClearErrors) {
  TempDir d("mk-cli-flags");
  const std::string out = d.str() + "/m";
  struct Case {
    std::vector<std::string> args;
    int code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--preset", "v4-pro", "--out", out}, 1, "--preset must be tiny or v4-flash"},
      {{"--preset", "tiny", "--experts", "1", "--out", out}, 1, "--experts must be in [2, 4096]"},
      {{"--preset", "tiny", "--experts", "5000", "--out", out}, 2, "--experts"},
      {{"--preset", "v4-flash", "--experts", "4", "--out", out}, 1, "--experts must be in [6, 4096]"},
      {{"--preset", "tiny", "--layers", "0", "--out", out}, 2, "--layers"},
      {{"--preset", "tiny", "--shards", "0", "--out", out}, 2, "--shards"},
      {{"--preset", "tiny"}, 2, "--out"},
      {{"--out", out}, 2, "--preset"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args = {BinPath("numoe"), "mkmodel"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    RunResult r = RunCommand(args, {.merge_stderr = true});
    EXPECT_EQ(r.rc, c.code) << r.out;
    EXPECT_THAT(r.out, HasSubstr(c.message));
  }
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace numoe::test
