// ModelMemory from configs and checkpoints: ComputeFootprint's bytes against hand-worked numbers, and
// the drafter stages a checkpoint actually ships.
#include "deploy/model_memory.h"

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/unit/deploy/full_size_model.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe::deploy {
namespace {

using ::testing::HasSubstr;

const std::string kData = NUMOE_TEST_DATA;

TEST(ModelMemory, FullSizeConfigMatchesTheModelCard) {
  // FullSizeModel() asserts every term against full_size_model.h's constants (147.17 GB routed, 10.27 GB
  // drafter, 3.45 GB per token); here the README's rounded figures too.
  ModelMemory m = testing::FullSizeModel();
  EXPECT_EQ(FormatBytes(m.routed_expert_bytes), "147.17 GB");
  EXPECT_EQ(FormatBytes(m.drafter_expert_bytes), "10.27 GB");
  EXPECT_EQ(FormatBytes(m.routed_bytes_per_token), "3.45 GB");
}

// tiny-v4: 5 layers x 8 experts of hidden 128, width 64, MXFP4. w1/w3 [64, 128]: 64 x 64 B of nibbles +
// 64 x 4 E8M0 scales = 4,352 B; w2 [128, 64]: 128 x 32 + 128 x 2 = 4,352 B; one expert 13,056 B.
TEST(ModelMemory, TinyCheckpointCountsItsDrafterStages) {
  auto m = LoadModelMemory(kData + "/tiny-v4");
  ASSERT_OK(m);
  EXPECT_EQ(m->name, "tiny-v4");
  EXPECT_EQ(m->routed_expert_bytes, 5 * 8 * 13'056);
  EXPECT_EQ(m->drafter_stages, 3);  // mtp.0..2 in the index
  EXPECT_EQ(m->drafter_expert_bytes, 3 * 8 * 13'056);
  EXPECT_EQ(m->routed_bytes_per_token, 5 * 2 * 13'056);  // top-2
  EXPECT_EQ(m->activation_bytes_per_token, 2 * 128 * 4 + 2 * (2 * 64 * 4 + 8));
  auto stages = CountDrafterStagesInIndex(kData + "/tiny-v4/model.safetensors.index.json");
  ASSERT_OK(stages);
  EXPECT_EQ(*stages, 3);
}

TEST(ModelMemory, DemoCheckpointHasNoDrafter) {
  auto m = LoadModelMemory(kData + "/demo-v4");
  ASSERT_OK(m);
  EXPECT_EQ(m->drafter_stages, 0);
  EXPECT_EQ(m->drafter_expert_bytes, 0);
  EXPECT_GT(m->routed_expert_bytes, 0);
}

TEST(ModelMemory, ErrorsNameTheFile) {
  auto missing = LoadModelMemory("/nonexistent/model");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("/nonexistent/model"));

  const test::TempDir tmp("numoe-model-memory");
  const std::filesystem::path& dir = tmp.path();
  {
    std::ofstream(dir / "bad_index.json") << R"({"weight_map": {"mtp.x.ffn.experts.0.w1.weight": "a"}})";
    std::ofstream(dir / "not_json.json") << "{";
    std::ofstream(dir / "no_map.json") << R"({"metadata": {}})";
  }
  auto bad = CountDrafterStagesInIndex((dir / "bad_index.json").string());
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("\"mtp.x.ffn.experts.0.w1.weight\" has a bad MTP stage"));
  EXPECT_THAT(std::string(CountDrafterStagesInIndex((dir / "not_json.json").string()).status().message()),
              HasSubstr("not valid JSON"));
  EXPECT_THAT(std::string(CountDrafterStagesInIndex((dir / "no_map.json").string()).status().message()),
              HasSubstr("weight_map must be an object"));
  EXPECT_EQ(CountDrafterStagesInIndex((dir / "absent.json").string()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace numoe::deploy
