// The one --spec policy (model/spec_policy.h) that numoe serve, numoe-gpu and numoe-worker share: what
// each --spec loads and drafts with, against the checkpoint's drafter and what the backend can run, and
// the refusals with what to change.
#include "model/spec_policy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace numoe {
namespace {

using ::testing::HasSubstr;

const CheckpointDrafter kDspark{.model_dir = "/m/dspark", .method = SpecMethod::kDspark, .mtp_stages = 3,
                                .dspark_block_size = 4};
const CheckpointDrafter kMtp{.model_dir = "/m/mtp", .method = SpecMethod::kMtp, .mtp_stages = 1};
const CheckpointDrafter kPlain{.model_dir = "/m/plain"};

std::string Message(const StatusOr<SpecPlan>& p) { return std::string(p.status().message()); }

TEST(SpecPolicy, AutoLoadsTheCheckpointsDrafterWhenTheBackendRunsIt) {
  auto cpu = ResolveSpec({}, kMtp, KnownDrafterSupport(Backend::kCpu, 1));
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ(cpu->load, SpecMethod::kMtp);
  EXPECT_EQ(cpu->config.method, SpecMethod::kMtp);
  EXPECT_EQ(cpu->config.depth, 5);  // no dspark_block_size: 5
  EXPECT_TRUE(cpu->note.empty());

  auto cuda = ResolveSpec({}, kMtp, KnownDrafterSupport(Backend::kCuda, 1));
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->load, SpecMethod::kNone);
  EXPECT_THAT(cuda->note, HasSubstr("the CUDA backend has no MTP drafter"));

  auto tp2 = ResolveSpec({}, kDspark, KnownDrafterSupport(Backend::kCuda, 2));
  ASSERT_TRUE(tp2.ok());
  EXPECT_EQ(tp2->load, SpecMethod::kNone);
  EXPECT_THAT(tp2->note, HasSubstr("--tp 1 only"));

  auto dspark = ResolveSpec({.depth = 0}, kDspark, KnownDrafterSupport(Backend::kCuda, 1));
  ASSERT_TRUE(dspark.ok());
  EXPECT_EQ(dspark->load, SpecMethod::kDspark);
  EXPECT_EQ(dspark->config.depth, 4);  // the checkpoint's dspark_block_size
}

TEST(SpecPolicy, ExplicitDraftersAreCheckedAgainstCheckpointAndBackend) {
  auto none = ResolveSpec({.spec = SpecChoice::kDspark}, kPlain, KnownDrafterSupport(Backend::kCpu, 1));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(none), HasSubstr("--spec dspark: /m/plain has no drafter stages"));
  EXPECT_THAT(Message(none), HasSubstr("use --spec ngram or none"));

  auto other = ResolveSpec({.spec = SpecChoice::kMtp}, kDspark, KnownDrafterSupport(Backend::kCpu, 1));
  EXPECT_THAT(Message(other), HasSubstr("a dspark drafter"));
  EXPECT_THAT(Message(other), HasSubstr("use --spec dspark, ngram or none"));

  auto cuda = ResolveSpec({.spec = SpecChoice::kMtp}, kMtp, KnownDrafterSupport(Backend::kCuda, 1));
  EXPECT_THAT(Message(cuda), HasSubstr("--spec mtp: the CUDA backend has no MTP drafter"));
  EXPECT_THAT(Message(cuda), HasSubstr("--backend cpu"));

  auto ngram = ResolveSpec({.spec = SpecChoice::kNgram, .depth = 3, .adaptive = true}, kPlain,
                           KnownDrafterSupport(Backend::kCuda, 4));
  ASSERT_TRUE(ngram.ok());
  EXPECT_EQ(ngram->load, SpecMethod::kNone);
  EXPECT_EQ(ngram->config.method, SpecMethod::kNgram);
  EXPECT_EQ(ngram->config.depth, 3);
  EXPECT_TRUE(ngram->config.adaptive);
}

TEST(SpecPolicy, AWorkerResolvesAutoAgainstWhatNumoeGpuDeclared) {
  auto plan = ResolveSpec({}, kDspark, DrafterSupport{});  // a worker: numoe-gpu's backend unknown
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->load, SpecMethod::kDspark);  // it loads the drafter's experts
  SpecPlan without = *plan;
  ASSERT_TRUE(CheckSpecAgainstGpu(&without, Capabilities{.verify = true}).ok());
  EXPECT_EQ(without.config.method, SpecMethod::kNone);  // numoe-gpu loaded no drafter
  SpecPlan with = *plan;
  ASSERT_TRUE(CheckSpecAgainstGpu(&with, Capabilities{.verify = true, .drafter = SpecMethod::kDspark}).ok());
  EXPECT_EQ(with.config.method, SpecMethod::kDspark);

  auto dspark = ResolveSpec({.spec = SpecChoice::kDspark, .depth = 6}, kDspark, DrafterSupport{});
  ASSERT_TRUE(dspark.ok());
  SpecPlan mismatch = *dspark;
  EXPECT_THAT(std::string(CheckSpecAgainstGpu(&mismatch, Capabilities{.verify = true}).message()),
              HasSubstr("--spec dspark: numoe-gpu drafts with none; start numoe-gpu with --spec dspark"));
  SpecPlan deep = *dspark;
  EXPECT_THAT(std::string(CheckSpecAgainstGpu(&deep, Capabilities{.verify = true, .drafter = SpecMethod::kDspark,
                                                                    .max_spec_tokens = 5})
                              .message()),
              HasSubstr("--spec-depth 6: numoe-gpu drafts at most 4 tokens per step"));
  SpecPlan unverified = *dspark;
  EXPECT_THAT(std::string(CheckSpecAgainstGpu(&unverified, Capabilities{.drafter = SpecMethod::kDspark}).message()),
              HasSubstr("cannot verify drafts"));
}

TEST(SpecPolicy, DrafterExpertsOnTheGpuNeedCuda) {
  EXPECT_TRUE(CheckDrafterExperts(DrafterExperts::kGpu, Backend::kCuda).ok());
  EXPECT_TRUE(CheckDrafterExperts(DrafterExperts::kWorker, Backend::kCpu).ok());
  EXPECT_THAT(std::string(CheckDrafterExperts(DrafterExperts::kGpu, Backend::kCpu).message()),
              HasSubstr("--drafter-experts gpu needs --backend cuda"));
}

TEST(Backend, AutoPicksCudaOnlyWithADevice) {
  EXPECT_EQ(ResolveBackend(Backend::kAuto, 0), Backend::kCpu);
  EXPECT_EQ(ResolveBackend(Backend::kAuto, 2), Backend::kCuda);
  EXPECT_EQ(ResolveBackend(Backend::kCpu, 8), Backend::kCpu);
  EXPECT_EQ(ResolveBackend(Backend::kCuda, 0), Backend::kCuda);
}

}  // namespace
}  // namespace numoe
