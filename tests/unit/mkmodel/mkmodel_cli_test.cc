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
#include "tests/unit/mkmodel/run_util.h"

namespace numoe::test {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const std::string kData = NUMOE_TEST_DATA;

// ---- the CLI, tiny preset ---------------------------------------------------------------------------------

std::map<std::string, uint64_t> Hashes(const fs::path& dir) {
  std::map<std::string, uint64_t> h;
  for (const auto& e : fs::directory_iterator(dir)) h[e.path().filename().string()] = HashFile(e.path());
  return h;
}

TEST(MkmodelCliTest, SameSeedSameBytesOtherSeedOtherWeights) {
  TempDir a("mk-cli-a"), b("mk-cli-b"), c("mk-cli-c");
  auto run = [](const TempDir& d, const char* seed, const char* threads) {
    return RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--seed", seed, "--threads", threads, "--out",
                d.str() + "/m"});
  };
  RunResult ra = run(a, "5", "1"), rb = run(b, "5", "2"), rc = run(c, "6", "2");
  ASSERT_EQ(ra.exit_code, 0) << ra.output;
  ASSERT_EQ(rb.exit_code, 0) << rb.output;
  ASSERT_EQ(rc.exit_code, 0) << rc.output;
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
  RunResult r = RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--out", d.str()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("it loads as a checkpoint"));
  auto ours = TensorStore::Open(d.str());
  auto fixture = TensorStore::Open(kData + "/tiny-v4");
  ASSERT_TRUE(ours.ok() && fixture.ok());
  ASSERT_EQ((*ours)->Names(), (*fixture)->Names());
  for (const std::string& name : (*fixture)->Names()) {
    const TensorView *a = (*ours)->Find(name), *b = (*fixture)->Find(name);
    EXPECT_EQ(a->dtype, b->dtype) << name;
    EXPECT_EQ(a->shape, b->shape) << name;
  }
  auto config = LoadModelConfig(d.str());
  auto fixture_config = LoadModelConfig(kData + "/tiny-v4");
  ASSERT_TRUE(config.ok() && fixture_config.ok());
  EXPECT_EQ(ModelConfigToJson(*config), ModelConfigToJson(*fixture_config));
  EXPECT_EQ(ReadFile(d.path() / "tokenizer.json"), ReadFile(kData + "/tiny-v4/tokenizer.json"));
  EXPECT_EQ(ReadFile(d.path() / "tokenizer_config.json"), ReadFile(kData + "/tiny-v4/tokenizer_config.json"));
  EXPECT_TRUE(tokenizer::Tokenizer::Load(d.str()).ok());
}

TEST(MkmodelCliTest, OutMustBeEmptyUnlessForce) {
  TempDir d("mk-cli-force");
  ASSERT_EQ(RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--out", d.str(), "--quiet"}).exit_code, 0);
  RunResult again = RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--out", d.str()});
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_THAT(again.output, HasSubstr("is not empty"));
  EXPECT_THAT(again.output, HasSubstr("--force"));

  // --force replaces the checkpoint, including shards of another shard count.
  RunResult forced = RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--shards", "3", "--force", "--out", d.str()});
  ASSERT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_FALSE(fs::exists(d.path() / "model-00001-of-00002.safetensors"));
  EXPECT_TRUE(fs::exists(d.path() / "model-00003-of-00003.safetensors"));
  EXPECT_TRUE(Checkpoint::Open(d.str()).ok());

  // ... but never deletes files that are not a checkpoint's.
  { std::ofstream(d.path() / "notes.txt") << "mine"; }
  RunResult foreign = RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--force", "--out", d.str()});
  EXPECT_EQ(foreign.exit_code, 1);
  EXPECT_THAT(foreign.output, HasSubstr("notes.txt"));
  EXPECT_TRUE(fs::exists(d.path() / "model-00003-of-00003.safetensors"));

  { std::ofstream(d.path() / "file") << "x"; }
  RunResult not_dir = RunProcess({NumoeBin(), "mkmodel", "--preset", "tiny", "--out", (d.path() / "file").string()});
  EXPECT_EQ(not_dir.exit_code, 1);
  EXPECT_THAT(not_dir.output, HasSubstr("is not a directory"));
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
    std::vector<std::string> args = {NumoeBin(), "mkmodel"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    RunResult r = RunProcess(args);
    EXPECT_EQ(r.exit_code, c.code) << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message));
  }
  EXPECT_FALSE(fs::exists(out));
}

}  // namespace
}  // namespace numoe::test
