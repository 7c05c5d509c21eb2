// Checkpoint::Open / LoadF32 / ExpectedTensors / ComputeFootprint on the fixtures and synthetic family members.
#include "common/checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace numoe {
namespace {

using ::testing::HasSubstr;

const std::string kData = NUMOE_TEST_DATA;

TEST(CheckpointFixture, TinyOpensAndLoads) {
  auto ck = Checkpoint::Open(kData + "/tiny-v4");
  ASSERT_TRUE(ck.ok()) << ck.status();
  const Checkpoint& c = **ck;
  EXPECT_EQ(c.mtp_stages(), 3);
  EXPECT_EQ(c.config().num_hidden_layers, 5);
  EXPECT_EQ(c.store().num_tensors(), 662u);

  auto wq = c.LoadF32("layers.0.attn.wq_a.weight");
  ASSERT_TRUE(wq.ok()) << wq.status();
  EXPECT_EQ(wq->shape, (std::vector<int64_t>{64, 128}));
  ASSERT_EQ(wq->data.size(), 64u * 128u);

  // MXFP4 expert: stored I8 [64, 64], logical [64, 128].
  auto raw = c.Raw("layers.0.ffn.experts.0.w1.weight");
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ((*raw)->dtype, DType::kI8);
  EXPECT_EQ((*raw)->shape, (std::vector<int64_t>{64, 64}));
  auto w1 = c.LoadF32("layers.0.ffn.experts.0.w1.weight");
  ASSERT_TRUE(w1.ok()) << w1.status();
  EXPECT_EQ(w1->shape, (std::vector<int64_t>{64, 128}));
  // Value check against the format definition: element (0,0) is the low nibble of byte 0 times its scale.
  auto scale = c.Raw("layers.0.ffn.experts.0.w1.scale");
  ASSERT_TRUE(scale.ok());
  const uint8_t b0 = (*raw)->data[0];
  EXPECT_EQ(w1->data[0], Fp4E2M1ToFloat(b0 & 0xF) * E8M0ToFloat((*scale)->data[0]));
  EXPECT_EQ(w1->data[1], Fp4E2M1ToFloat(b0 >> 4) * E8M0ToFloat((*scale)->data[0]));

  auto w2 = c.LoadF32("layers.0.ffn.experts.7.w2.weight");
  ASSERT_TRUE(w2.ok()) << w2.status();
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{128, 64}));

  auto embed = c.LoadF32("embed.weight");
  ASSERT_TRUE(embed.ok());
  EXPECT_EQ(embed->shape, (std::vector<int64_t>{1024, 128}));
  for (float v : embed->data) ASSERT_TRUE(std::isfinite(v));

  auto main_proj = c.LoadF32("mtp.0.main_proj.weight");
  ASSERT_TRUE(main_proj.ok());
  EXPECT_EQ(main_proj->shape, (std::vector<int64_t>{128, 384}));

  auto missing = c.LoadF32("layers.9.attn.wq_a.weight");
  EXPECT_FALSE(missing.ok());
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("layers.9.attn.wq_a.weight"));
}

TEST(CheckpointFixture, DemoOpens) {
  auto ck = Checkpoint::Open(kData + "/demo-v4");
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ((*ck)->mtp_stages(), 0);
  auto w = (*ck)->LoadF32("layers.3.ffn.experts.15.w3.weight");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->shape, (std::vector<int64_t>{256, 256}));
  auto tid = (*ck)->LoadF32("layers.0.ffn.gate.tid2eid");
  ASSERT_TRUE(tid.ok());
  EXPECT_EQ(tid->shape, (std::vector<int64_t>{1024, 2}));
}

TEST(Footprint, FlashConfig) {
  auto c = LoadModelConfig(kData + "/v4-flash-0731.config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->DefaultMtpStages(), 3);
  const ModelFootprint fp = ComputeFootprint(*c, c->DefaultMtpStages());
  // 43 x 256 x 3 x 4096 x 2048 params at 4.25 bits.
  const double routed = 43.0 * 256 * 3 * 4096 * 2048 * 4.25 / 8;
  EXPECT_EQ(static_cast<double>(fp.routed_expert_bytes), routed);
  EXPECT_NEAR(fp.routed_expert_bytes / 1e9, 147.2, 0.05);
  EXPECT_NEAR(fp.routed_bytes_per_token / 1e9, 3.45, 0.005);
  EXPECT_EQ(static_cast<double>(fp.routed_bytes_per_token), 43.0 * 6 * 3 * 4096 * 2048 * 4.25 / 8);
  EXPECT_GT(fp.mtp_routed_expert_bytes, 0);
  EXPECT_GT(fp.other_bytes, 0);
}

}  // namespace
}  // namespace numoe
