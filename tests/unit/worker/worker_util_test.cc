// numoe-worker's small pieces: the progress line's text, placement errors (checked before anything is
// bound), and the proto -> engine request conversion (proto3 zeros mean "unset").
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

WorkerPlacement Placement(std::vector<int> nodes, int threads, std::vector<int> thread_cpus = {}) {
  WorkerPlacement p;
  p.nodes = std::move(nodes);
  p.threads = threads;
  p.thread_cpus = std::move(thread_cpus);
  return p;
}

TEST(NumaBind, BadNodesAndCpusAreErrorsBeforeBinding) {
  auto b = ApplyPlacement(Placement({4096}, 0));
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--numa-node: node 4096 does not exist"), std::string::npos) << b.status();
  b = ApplyPlacement(Placement({0, 0}, 0));
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("listed twice"), std::string::npos) << b.status();
  b = ApplyPlacement(Placement({0}, 0, {100000}));
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--cpus: CPU 100000"), std::string::npos) << b.status();
  // No nodes (--no-numa-bind): nothing is bound, the threads are the placement's.
  auto u = ApplyPlacement(Placement({}, 3));
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->threads, 3);
  EXPECT_TRUE(u->cpus.empty());
  EXPECT_TRUE(u->nodes.empty());
}

// The worker's check on a described machine: every refusal names the flag and the bad value.
TEST(NumaBind, ValidatePlacementRefusesByName) {
  Topology t;
  t.name = "described";
  for (int id : {0, 2}) {
    NumaNode n;
    n.id = id;
    n.cpu_ids = id == 0 ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{4, 5, 6, 7};
    n.num_cpus = 4;
    n.memory_bytes = 1 << 30;
    t.nodes.push_back(n);
  }
  auto error = [&](const WorkerPlacement& p) {
    Status st = ValidatePlacement(p, t);
    EXPECT_FALSE(st.ok());
    return std::string(st.message());
  };
  EXPECT_TRUE(ValidatePlacement(Placement({0}, 2, {0, 1}), t).ok());
  EXPECT_TRUE(ValidatePlacement(Placement({0, 2}, 8), t).ok());
  EXPECT_TRUE(ValidatePlacement(Placement({}, 2, {3, 4}), t).ok());  // unbound: any allowed CPU
  EXPECT_NE(error(Placement({1}, 1)).find("--numa-node: node 1 does not exist or has no CPUs this process may run "
                                          "on (usable nodes: 0,2)"),
            std::string::npos);
  EXPECT_NE(error(Placement({2, 0, 2}, 1)).find("--numa-node: node 2 is listed twice"), std::string::npos);
  EXPECT_NE(error(Placement({0}, 1, {5})).find("--cpus: CPU 5 is not a usable CPU of node(s) 0 (usable: 0-3)"),
            std::string::npos);
  EXPECT_NE(error(Placement({}, 1, {9})).find("--cpus: CPU 9 is not a usable CPU of this process (usable: 0-7)"),
            std::string::npos);
  EXPECT_NE(error(Placement({0}, 2, {1, 1})).find("--cpus: CPU 1 is listed twice"), std::string::npos);
  EXPECT_NE(error(Placement({0}, 3, {0, 1})).find("--threads 3 disagrees with --cpus (2 CPUs, one per kernel thread)"),
            std::string::npos);
  EXPECT_NE(error(Placement({0}, 0)).find("--threads must be >= 1 (got 0)"), std::string::npos);
  WorkerPlacement outside = Placement({0}, 1, {0});
  outside.cpus = {0, 6};
  EXPECT_NE(error(outside).find("placement: CPU 6 is not a CPU of node(s) 0"), std::string::npos);
  WorkerPlacement narrowed = Placement({0}, 1, {2});
  narrowed.cpus = {0, 1};  // thread CPUs come from the placement's CPU set when it has one
  EXPECT_NE(error(narrowed).find("--cpus: CPU 2 is not a usable CPU of node(s) 0 (usable: 0-1)"), std::string::npos);
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
