// numoe-worker's small pieces: the progress line's text, NUMA binding errors (checked before anything
// is bound), and the proto -> engine request conversion (proto3 zeros mean "unset").
#include <gtest/gtest.h>

#include "worker/service/numa_bind.h"
#include "worker/service/progress.h"
#include "worker/service/worker_service.h"
#include "tests/support/status_matchers.h"

namespace numoe::worker {
namespace {

TEST(Progress, FormatsGbRateAndEta) {
  const std::string mid = ProgressBar::Format("loading", 50'000'000'000, 150'000'000'000, 10.0, 10);
  EXPECT_NE(mid.find("50.00 / 150.00 GB"), std::string::npos) << mid;
  EXPECT_NE(mid.find("[###.......]"), std::string::npos) << mid;
  EXPECT_NE(mid.find(" 33%"), std::string::npos) << mid;
  EXPECT_NE(mid.find("5.00 GB/s"), std::string::npos) << mid;
  EXPECT_NE(mid.find("ETA 20 s"), std::string::npos) << mid;
  const std::string done = ProgressBar::Format("loading", 150'000'000'000, 150'000'000'000, 30.0, 10);
  EXPECT_NE(done.find("100%"), std::string::npos) << done;
  EXPECT_NE(done.find("in 30.0 s"), std::string::npos) << done;
  EXPECT_EQ(done.find("ETA"), std::string::npos) << done;
  // Small loads in MB; nothing done yet has no ETA to offer.
  const std::string small = ProgressBar::Format("loading", 0, 520'000, 0.0, 10);
  EXPECT_NE(small.find("0.00 / 0.52 MB"), std::string::npos) << small;
  EXPECT_NE(small.find("ETA --"), std::string::npos) << small;
}

TEST(NumaBind, BadNodesAndCpusAreErrorsBeforeBinding) {
  auto b = BindToNumaNodes({4096}, 0);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--numa-node: node 4096 does not exist"), std::string::npos) << b.status();
  b = BindToNumaNodes({0, 0}, 0);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("listed twice"), std::string::npos) << b.status();
  b = BindToNumaNodes({0}, 0, {100000});
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--cpus: CPU 100000"), std::string::npos) << b.status();
  const NumaBinding u = Unbound(3);
  EXPECT_EQ(u.threads, 3);
  EXPECT_TRUE(u.cpus.empty());
  EXPECT_TRUE(u.nodes.empty());
}

TEST(WorkerService, ProtoZerosMeanDefaults) {
  v1::WorkerGenerateRequest req;
  req.add_prompt_ids(5);
  auto r = ToEngineRequest(req, 77);
  ASSERT_OK(r);
  EXPECT_EQ(r->max_new_tokens, 77);
  EXPECT_EQ(r->sampling.top_p, 1.0);
  EXPECT_EQ(r->sampling.temperature, 0.0);
  req.set_max_new_tokens(3);
  req.mutable_sampling()->set_top_p(0.5f);
  req.mutable_sampling()->set_top_k(7);
  req.mutable_sampling()->set_seed(9);
  req.add_stop_token_ids(11);
  r = ToEngineRequest(req, 77);
  ASSERT_OK(r);
  EXPECT_EQ(r->max_new_tokens, 3);
  EXPECT_FLOAT_EQ(static_cast<float>(r->sampling.top_p), 0.5f);
  EXPECT_EQ(r->sampling.top_k, 7);
  EXPECT_EQ(r->sampling.seed, 9u);
  EXPECT_EQ(r->stop_token_ids, std::vector<int32_t>{11});
}

}  // namespace
}  // namespace numoe::worker
