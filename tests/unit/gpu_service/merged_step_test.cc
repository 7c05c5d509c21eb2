// The row split and gather of a merged pass (gpu_service/merged_step.h), and the slicing of a merged step's
// output back into each part's.
#include "gpu_service/merged_step.h"

#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"

namespace numoe::gpu {
namespace {

TEST(MergedStep, SplitRowsByOwnerKeepsOrderAndGatherScatterRoundTrips) {
  // Rows of sequences 7, 3, 7, 9, 3: parts {7, 9} -> 0, {3} -> 1.
  const int64_t seqs[] = {7, 3, 7, 9, 3};
  ASSERT_OK_AND_ASSIGN(RowSplit s, SplitRows(seqs, 5, 2, [](int64_t q) { return q == 3 ? 1 : 0; }));
  ASSERT_EQ(s.rows.size(), 2u);
  EXPECT_EQ(s.rows[0], (std::vector<int64_t>{0, 2, 3}));
  EXPECT_EQ(s.rows[1], (std::vector<int64_t>{1, 4}));

  const int64_t D = 3;
  std::vector<float> x(5 * D);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i);
  std::vector<float> part(3 * D);
  GatherRows(x.data(), D, s.rows[0], part.data());
  EXPECT_EQ(part, (std::vector<float>{0, 1, 2, 6, 7, 8, 9, 10, 11}));
  std::vector<float> back(5 * D, -1.0f);
  GatherRows(x.data(), D, s.rows[1], part.data());
  ScatterRows(part.data(), D, s.rows[1], back.data());
  EXPECT_EQ(back, (std::vector<float>{-1, -1, -1, 3, 4, 5, -1, -1, -1, -1, -1, -1, 12, 13, 14}));
}

TEST(MergedStep, SplitRowsRefusesUnknownSequencesAndMissingRowSeqs) {
  const int64_t seqs[] = {1, 2};
  auto s = SplitRows(seqs, 2, 1, [](int64_t q) { return q == 1 ? 0 : -1; });
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("sequence 2"), std::string::npos) << s.status();
  EXPECT_EQ(SplitRows(nullptr, 2, 1, [](int64_t) { return 0; }).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_OK(SplitRows(nullptr, 0, 1, [](int64_t) { return 0; }).status());
}

TEST(MergedStep, SliceStepOutputGivesEachPartItsItems) {
  // Three items: 0 samples 1 token; 1 speculative, emits 3, with logits; 2 no sample, logits.
  std::vector<StepItem> items(3);
  items[1].logits = true;
  items[2].logits = true;
  StepOutput all;
  all.tokens = {11, 21, -1};
  all.counts = {1, 3, 0};
  all.emitted = {11, 21, 22, 23};
  all.drafted = {0, 2, 0};
  all.accepted = {0, 2, 0};
  all.cached = {0, 5, 1};
  all.logits = {{1.0f, 1.5f}, {3.0f}};  // one entry per item with logits (1, 2)
  all.logprobs.resize(4);
  all.logprobs[2].chosen.token = 22;

  StepOutput a, b;
  SliceStepOutput(all, items, 0, 1, &a);
  SliceStepOutput(all, items, 1, 3, &b);
  EXPECT_EQ(a.tokens, (std::vector<int32_t>{11}));
  EXPECT_EQ(a.emitted, (std::vector<int32_t>{11}));
  EXPECT_TRUE(a.logits.empty());
  EXPECT_EQ(a.logprobs.size(), 1u);
  EXPECT_EQ(b.tokens, (std::vector<int32_t>{21, -1}));
  EXPECT_EQ(b.counts, (std::vector<int32_t>{3, 0}));
  EXPECT_EQ(b.emitted, (std::vector<int32_t>{21, 22, 23}));
  EXPECT_EQ(b.drafted, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(b.accepted, (std::vector<int32_t>{2, 0}));
  EXPECT_EQ(b.cached, (std::vector<int32_t>{5, 1}));
  ASSERT_EQ(b.logits.size(), 2u);
  EXPECT_EQ(b.logits[0], (std::vector<float>{1.0f, 1.5f}));
  ASSERT_EQ(b.logprobs.size(), 3u);
  EXPECT_EQ(b.logprobs[1].chosen.token, 22);
}

}  // namespace
}  // namespace numoe::gpu
