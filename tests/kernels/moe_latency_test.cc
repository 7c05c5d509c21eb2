// The fixed cost of a MoE step: tiny steps run on the calling thread without handing anything to the pool,
// and no step allocates from the heap once MoeCompute's scratch has grown to the step's size. This binary
// replaces the global operator new to count allocations.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "tests/kernels/expert_test_util.h"
#include "worker/experts/expert_layer.h"
#include "worker/experts/isa.h"
#include "worker/experts/moe_compute.h"
#include "tests/support/status_matchers.h"

// GCC pairs the inlined malloc in operator new with the free in operator delete and warns; the pair is
// exactly the replacement the standard allows.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace numoe {
namespace {

// tiny-v4's expert shapes: hidden 128, inter 64, 8 experts, top-2.
constexpr int64_t kHidden = 128, kInter = 64, kExperts = 8, kTopK = 2;

class MoeLatencyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto isa = SelectIsa();
    ASSERT_OK(isa);
    isa_ = *isa;
    std::mt19937 rng(7);
    experts_ = test::RandomExperts(kExperts, kHidden, kInter, rng);
    auto layer = ExpertLayer::Pack(kHidden, kInter, test::Refs(experts_), isa_);
    ASSERT_OK(layer);
    layer_ = std::move(*layer);
  }

  // A step of `rows` rows with routing drawn from `seed`.
  struct Step {
    std::vector<float> x, weights, out;
    std::vector<int32_t> ids;
    MoeBatch batch;
  };
  static void MakeStep(int64_t rows, uint32_t seed, Step* s) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> ux(-1.0f, 1.0f), uw(0.1f, 1.0f);
    std::uniform_int_distribution<int32_t> ue(0, kExperts - 1);
    s->x.resize(rows * kHidden);
    s->out.resize(rows * kHidden);
    s->weights.resize(rows * kTopK);
    s->ids.resize(rows * kTopK);
    for (auto& v : s->x) v = ux(rng);
    for (auto& v : s->weights) v = uw(rng);
    for (auto& v : s->ids) v = ue(rng);
    s->batch = MoeBatch{rows, kTopK, s->x.data(), s->ids.data(), s->weights.data(), s->out.data()};
  }

  Isa isa_ = Isa::kGeneric;
  std::vector<test::OwnedExpert> experts_;
  std::unique_ptr<ExpertLayer> layer_;
};

TEST_F(MoeLatencyTest, TinyStepsRunInlineWithoutWakingThePool) {
  ThreadPool pool(2);
  MoeCompute moe(&pool, isa_);
  std::vector<Step> steps(16);
  for (size_t i = 0; i < steps.size(); ++i) MakeStep(1, 100 + static_cast<uint32_t>(i), &steps[i]);
  ASSERT_OK(moe.Run(*layer_, 1.0f, steps[0].batch));  // warm-up: scratch grows here
  const uint64_t jobs = pool.jobs_dispatched();
  const int64_t allocs = g_allocations.load();
  for (int i = 0; i < 500; ++i) ASSERT_OK(moe.Run(*layer_, 1.0f, steps[i % steps.size()].batch));
  EXPECT_EQ(g_allocations.load() - allocs, 0) << "heap allocations in 500 decode steps";
  EXPECT_EQ(pool.jobs_dispatched(), jobs) << "a 1-row step of 2 tiny experts was handed to the pool";
  EXPECT_EQ(moe.inline_runs(), 501);
  EXPECT_EQ(moe.pooled_runs(), 0);
}

TEST_F(MoeLatencyTest, PooledStepsDoNotAllocateOnceWarm) {
  ThreadPool pool(2);
  MoeComputeOptions o;
  o.inline_max_bytes = 0;  // every step through the pool
  MoeCompute moe(&pool, isa_, o);
  Step big, small;
  MakeStep(64, 1, &big);
  MakeStep(3, 2, &small);
  ASSERT_OK(moe.Run(*layer_, 1.0f, big.batch));  // the largest step first: scratch is then big enough
  const uint64_t jobs = pool.jobs_dispatched();
  const int64_t allocs = g_allocations.load();
  for (int i = 0; i < 200; ++i) ASSERT_OK(moe.Run(*layer_, 1.0f, (i % 2 ? big : small).batch));
  EXPECT_EQ(g_allocations.load() - allocs, 0) << "heap allocations in 200 pooled steps";
  EXPECT_EQ(pool.jobs_dispatched() - jobs, 200u);
  EXPECT_EQ(moe.pooled_runs(), 201);
}

// More threads than this machine has cores: workers wake late, skip steps or join halfway, and every
// step must still equal the inline result bit for bit.
TEST_F(MoeLatencyTest, OversubscribedPoolMatchesInlineBitwise) {
  ThreadPool pool(5);
  MoeComputeOptions pooled_options, alone_options;
  pooled_options.inline_max_bytes = 0;
  alone_options.inline_max_bytes = std::numeric_limits<int64_t>::max();
  MoeCompute pooled(&pool, isa_, pooled_options), alone(&pool, isa_, alone_options);
  for (int i = 0; i < 300; ++i) {
    Step s;
    MakeStep(1 + i % 23, 1000 + static_cast<uint32_t>(i), &s);
    ASSERT_OK(pooled.Run(*layer_, 1.0f, s.batch));
    const std::vector<float> got = s.out;
    std::fill(s.out.begin(), s.out.end(), -1.0f);
    ASSERT_OK(alone.Run(*layer_, 1.0f, s.batch));
    ASSERT_EQ(std::memcmp(got.data(), s.out.data(), sizeof(float) * s.out.size()), 0) << "step " << i;
  }
  EXPECT_EQ(pooled.pooled_runs(), 300);
  EXPECT_EQ(alone.inline_runs(), 300);
}

// Not a pass/fail timing test (the machine is shared): records the per-step latency of both paths.
TEST_F(MoeLatencyTest, ReportsStepLatency) {
  ThreadPool pool(2);
  MoeComputeOptions pooled_options;
  pooled_options.inline_max_bytes = 0;
  MoeCompute inline_moe(&pool, isa_), pooled_moe(&pool, isa_, pooled_options);
  Step s;
  MakeStep(1, 3, &s);
  const auto median_us = [&](MoeCompute& moe) {
    std::vector<double> t;
    for (int i = 0; i < 2000; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      EXPECT_OK(moe.Run(*layer_, 1.0f, s.batch));
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
    return t[t.size() / 2];
  };
  const double inline_us = median_us(inline_moe), pooled_us = median_us(pooled_moe);
  RecordProperty("inline_step_us", std::to_string(inline_us));
  RecordProperty("pooled_step_us", std::to_string(pooled_us));
  std::printf("1-row tiny step (%s): inline %.2f us, through the pool %.2f us (medians)\n", IsaName(isa_), inline_us,
              pooled_us);
  EXPECT_GT(inline_us, 0.0);
}

}  // namespace
}  // namespace numoe
