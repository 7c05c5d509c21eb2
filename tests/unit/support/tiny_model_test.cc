// The tiny-model fixture loads once per process and per drafter choice; kTinyMtp is the synthetic MTP one.
#include <gtest/gtest.h>

#include "backends/cpu/cpu_model.h"
#include "common/checkpoint.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe::test {
namespace {

TEST(TinyModel, LoadsOncePerModelAndDrafter) {
  ASSERT_OK_AND_ASSIGN(TinyModel* plain, TinyModel::Get());
  ASSERT_OK_AND_ASSIGN(TinyModel* again, TinyModel::Get({.model = "tiny-v4"}));
  ASSERT_OK_AND_ASSIGN(TinyModel* drafter, TinyModel::Get({.drafter = true}));
  EXPECT_EQ(plain, again);
  EXPECT_NE(plain, drafter);
  ASSERT_NE(plain->model, nullptr);
  ASSERT_NE(plain->experts, nullptr);
  EXPECT_EQ(plain->model->vocab_size(), plain->ckpt->config().vocab_size);
  ASSERT_OK_AND_ASSIGN(const Goldens goldens, Goldens::Load(TinyDir()));
  EXPECT_EQ(plain->goldens.size(), goldens.size());  // the directory's goldens come with it
  EXPECT_EQ(plain->model->drafter(), SpecMethod::kNone);
  EXPECT_EQ(drafter->model->drafter(), SpecMethod::kDspark);  // tiny-v4 has DSpark stages
}

TEST(TinyModel, TheMtpFixtureIsSyntheticWithOneBlock) {
  ASSERT_OK_AND_ASSIGN(TinyModel* mtp, TinyModel::Get({.model = kTinyMtp, .drafter = true}));
  ASSERT_OK_AND_ASSIGN(TinyModel* again, TinyModel::Get({.model = kTinyMtp, .drafter = true}));
  EXPECT_EQ(mtp, again);
  EXPECT_EQ(mtp->ckpt->mtp_stages(), 1);
  EXPECT_EQ(mtp->ckpt->config().dspark_block_size, 0);
  EXPECT_EQ(mtp->model->drafter(), SpecMethod::kMtp);
  EXPECT_EQ(mtp->goldens.size(), 0u);  // no goldens for random weights
}

TEST(TinyModel, AMissingModelIsAnErrorNamingIt) {
  const auto m = TinyModel::Get({.model = "no-such-model"});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().ToString().find("no-such-model"), std::string::npos) << m.status();
}

}  // namespace
}  // namespace numoe::test
