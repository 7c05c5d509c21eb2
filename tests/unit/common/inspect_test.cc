// Runs the `numoe inspect` binary on the fixtures and on corrupt copies, asserting its output and exit code.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/support/files.h"
#include "tests/support/process.h"

namespace numoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using test::TempDir;

const std::string kData = NUMOE_TEST_DATA;
const std::string kNumoe = test::BinPath("numoe");

using CliRun = test::RunResult;

// `numoe inspect ARGS`.
CliRun Inspect(const std::string& args) { return test::RunCommand(test::CommandLine(kNumoe, "inspect " + args)); }

TEST(Inspect, TinyModel) {
  CliRun r = Inspect("--model '" + kData + "/tiny-v4'");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("layers: 5 (sliding 1, CSA 2 at rate 4, HCA 2 at rate 128)"),
                           HasSubstr("attention schedule: SCHCH"), HasSubstr("2 hash-routed + 3 scored layers"),
                           HasSubstr("8 routed experts, top-2"), HasSubstr("hidden 128, vocab 1024"),
                           HasSubstr("DSpark stages: 3"), HasSubstr("tensors: 662"), HasSubstr("I8           192 tensors"),
                           HasSubstr("I64            2 tensors")));
  // 5 layers x 8 experts x 3 matrices x (64x64 packed bytes + 64x4 scales, or 128x32 + 128x2).
  EXPECT_THAT(r.out, HasSubstr("routed experts: 522.2 KB  (522240 bytes"));
  EXPECT_THAT(r.out, HasSubstr("routed expert bytes per token: 130.6 KB  (130560 bytes; top-2 of 8 in each of 5 layers"));
  EXPECT_TRUE(r.err.empty()) << r.err;
}

TEST(Inspect, TinyModelJson) {
  CliRun r = Inspect("--model '" + kData + "/tiny-v4' --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["tensors"]["count"], 662);
  EXPECT_EQ(j["tensors"]["bytes"], 3297047);  // the index's total_size
  EXPECT_EQ(j["tensors"]["by_dtype"]["I8"]["count"], 192);
  EXPECT_EQ(j["architecture"]["mtp_stages"], 3);
  EXPECT_EQ(j["architecture"]["layers_by_attention"]["csa"], 2);
  EXPECT_EQ(j["memory"]["routed_expert_bytes"], 522240);
  const int64_t sum = j["memory"]["routed_expert_bytes"].get<int64_t>() +
                      j["memory"]["mtp_routed_expert_bytes"].get<int64_t>() + j["memory"]["other_bytes"].get<int64_t>();
  EXPECT_EQ(sum, 3297047);
}

TEST(Inspect, FlashConfig) {
  CliRun r = Inspect("--config '" + kData + "/v4-flash-0731.config.json'");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_THAT(r.out, AllOf(HasSubstr("routed experts: 147.2 GB"), HasSubstr("routed expert bytes per token: 3.45 GB"),
                           HasSubstr("layers: 43 (sliding 2, CSA 21 at rate 4, HCA 20 at rate 128)"),
                           HasSubstr("3 hash-routed + 40 scored layers"), HasSubstr("256 routed experts, top-6"),
                           HasSubstr("DSpark stages: 3"),
                           HasSubstr("tensors (expected in the official layout): 72317")));
  CliRun j = Inspect("--config '" + kData + "/v4-flash-0731.config.json' --json");
  ASSERT_EQ(j.rc, 0) << j.err;
  const auto js = nlohmann::json::parse(j.out);
  EXPECT_EQ(js["memory"]["routed_expert_bytes"].get<double>(), 43.0 * 256 * 3 * 4096 * 2048 * 4.25 / 8);
  EXPECT_EQ(js["memory"]["routed_bytes_per_token"].get<double>(), 43.0 * 6 * 3 * 4096 * 2048 * 4.25 / 8);
}

TEST(Inspect, TruncatedShardFails) {
  TempDir d;
  test::CopyFiles(kData + "/tiny-v4", d.str());
  const std::string shard = d / "model-00001-of-00002.safetensors";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) / 2);
  CliRun r = Inspect("--model '" + d.str() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, AllOf(HasSubstr("model-00001-of-00002.safetensors"), HasSubstr("past the data section")));
  EXPECT_TRUE(r.out.empty());
}

TEST(Inspect, HeaderBombFails) {
  TempDir d;
  test::CopyFiles(kData + "/tiny-v4", d.str());
  const std::string shard = d / "model-00002-of-00002.safetensors";
  std::string raw = test::ReadFile(shard);
  const uint64_t bomb = uint64_t{1} << 63;
  std::memcpy(raw.data(), &bomb, 8);
  test::WriteFile(shard, raw);
  CliRun r = Inspect("--model '" + d.str() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, AllOf(HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("absurd")));
}

TEST(Inspect, ValidationAndUsageErrors) {
  TempDir d;
  test::CopyFiles(kData + "/tiny-v4", d.str());
  std::string cfg = test::ReadFile(d / "config.json");
  cfg.replace(cfg.find("\"num_key_value_heads\": 1"), 24, "\"num_key_value_heads\": 2");
  test::WriteFile(d / "config.json", cfg);
  CliRun r = Inspect("--model '" + d.str() + "'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("num_key_value_heads must be 1 (got 2)"));
  r = Inspect("--config '" + d.str() + "/nope.json'");
  EXPECT_EQ(r.rc, 1);
  EXPECT_THAT(r.err, HasSubstr("nope.json"));
  r = Inspect("");
  EXPECT_EQ(r.rc, 2);
  EXPECT_THAT(r.err, HasSubstr("--model"));
}

}  // namespace
}  // namespace numoe
