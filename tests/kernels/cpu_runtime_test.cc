// CPU runtime pieces under the expert kernels: feature probe, ISA selection, thread pool, NUMA helpers.
#include <gtest/gtest.h>
#include <sched.h>
#include <stdlib.h>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "common/cpu_features.h"
#include "common/numa.h"
#include "common/thread_pool.h"
#include "common/topology.h"
#include "worker/experts/isa.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

TEST(CpuFeatures, ImpliedFeaturesAreConsistent) {
  const CpuFeatures& f = GetCpuFeatures();
  EXPECT_EQ(&f, &GetCpuFeatures());
  if (f.avx512bw || f.avx512vl || f.avx512vnni || f.avx512bf16) {
    EXPECT_TRUE(f.avx512f);
  }
  if (f.amx_tile || f.amx_int8 || f.amx_bf16) {
    EXPECT_TRUE(f.amx_os_enabled);
  }
  EXPECT_FALSE(f.ToString().empty());
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() { had_ ? setenv(name_, old_.c_str(), 1) : unsetenv(name_); }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(SelectIsa, BestAvailableAndOverride) {
  {
    ScopedEnv env("NUMOE_ISA", "");
    auto best = SelectIsa();
    ASSERT_OK(best);
    EXPECT_TRUE(IsaAvailable(*best));
    for (Isa better : {Isa::kAmx, Isa::kAvx512, Isa::kAvx2}) {
      if (better == *best) break;
      EXPECT_FALSE(IsaAvailable(better)) << IsaName(better) << " is available but " << IsaName(*best) << " chosen";
    }
  }
  {
    ScopedEnv env("NUMOE_ISA", "generic");
    auto isa = SelectIsa();
    ASSERT_OK(isa);
    EXPECT_EQ(*isa, Isa::kGeneric);
  }
  {
    ScopedEnv env("NUMOE_ISA", "sse9");
    EXPECT_EQ(SelectIsa().status().code(), absl::StatusCode::kInvalidArgument);
  }
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAmx}) {
    ScopedEnv env("NUMOE_ISA", IsaName(isa));
    auto got = SelectIsa();
    if (IsaAvailable(isa)) {
      ASSERT_OK(got);
      EXPECT_EQ(*got, isa);
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition) << IsaName(isa);
    }
  }
}

TEST(ThreadPool, ParallelForCoversEachIndexOnce) {
  ThreadPool pool(3);
  for (int64_t n : {0, 1, 2, 3, 7, 1000}) {
    std::vector<std::atomic<int>> hits(n);
    pool.ParallelFor(n, [&](int64_t b, int64_t e, int t) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 3);
      for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
    std::vector<std::atomic<int>> hits2(n);
    pool.ParallelForDynamic(n, 4, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) hits2[i].fetch_add(1);
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits2[i].load(), 1) << i;
  }
}

TEST(ThreadPool, BarrierSeparatesPhases) {
  ThreadPool pool(4);
  std::atomic<int> phase1{0};
  std::atomic<bool> early{false};
  for (int rep = 0; rep < 200; ++rep) {
    phase1 = 0;
    pool.RunOnAll([&](int t) {
      phase1.fetch_add(1);
      pool.Barrier(t);
      if (phase1.load() != 4) early = true;
      pool.Barrier(t);
    });
  }
  EXPECT_FALSE(early.load());
}

TEST(ThreadPool, UnpinnedCallerIsThreadZero) {
  const std::thread::id caller = std::this_thread::get_id();
  {
    ThreadPool pool(1);  // no workers: everything inline, nothing handed off
    int calls = 0;
    pool.RunOnAll([&](int t) {
      EXPECT_EQ(t, 0);
      EXPECT_EQ(std::this_thread::get_id(), caller);
      ++calls;
    });
    pool.RunOnAvailable([&](int t) {
      EXPECT_EQ(t, 0);
      EXPECT_EQ(std::this_thread::get_id(), caller);
      ++calls;
    });
    pool.ParallelFor(10, [&](int64_t b, int64_t e, int) { calls += static_cast<int>(e - b); });
    EXPECT_EQ(calls, 12);
    EXPECT_EQ(pool.jobs_dispatched(), 0u);
  }
  ThreadPool pool(3);
  EXPECT_TRUE(pool.caller_participates());
  std::vector<std::thread::id> ids(3);
  pool.RunOnAll([&](int t) { ids[t] = std::this_thread::get_id(); });
  EXPECT_EQ(ids[0], caller);
  EXPECT_NE(ids[1], caller);
  EXPECT_NE(ids[2], caller);
  EXPECT_NE(ids[1], ids[2]);
  EXPECT_EQ(pool.jobs_dispatched(), 1u);
}

// RunOnAvailable on an oversubscribed pool (more threads than this machine's cores), mixed with RunOnAll:
// every job's work is done exactly once, no thread index runs twice in a job, the caller takes part, and
// no thread is still inside (or enters) a job after the call returned.
TEST(ThreadPool, RunOnAvailableSkipsLateWorkersSafely) {
  constexpr int kThreads = 6;
  ThreadPool pool(kThreads);
  std::atomic<int> inside{0};
  std::atomic<int> current{-1};
  std::atomic<bool> bad{false};
  for (int job = 0; job < 3000; ++job) {
    current.store(job);
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::vector<std::atomic<int>> runs(kThreads);
    const int64_t n = 1 + job % 37;
    bool caller_ran = false;
    const auto fn = [&, job](int t) {
      inside.fetch_add(1);
      if (current.load() != job || runs[t].fetch_add(1) != 0) bad = true;
      if (t == 0) caller_ran = true;
      for (int64_t i; (i = next.fetch_add(1)) < n;) done.fetch_add(1);
      inside.fetch_sub(1);
    };
    if (job % 5 == 4) {
      pool.RunOnAll(fn);
      for (auto& r : runs) ASSERT_EQ(r.load(), 1);
    } else {
      pool.RunOnAvailable(fn);
    }
    ASSERT_EQ(inside.load(), 0) << "job " << job;
    ASSERT_EQ(done.load(), n) << "job " << job;
    ASSERT_TRUE(caller_ran) << "job " << job;
    ASSERT_FALSE(bad.load()) << "job " << job;
  }
  current.store(-2);
  EXPECT_EQ(inside.load(), 0);
}

TEST(ThreadPool, PinnedRunOnAvailableUsesWorkersOnly) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c)
    if (CPU_ISSET(c, &allowed)) first = c;
  auto pool = ThreadPool::Create({.num_threads = 2, .cpus = {first}});
  ASSERT_OK(pool);
  EXPECT_FALSE((*pool)->caller_participates());
  const std::thread::id caller = std::this_thread::get_id();
  for (int rep = 0; rep < 200; ++rep) {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<bool> on_caller{false};
    (*pool)->RunOnAvailable([&](int t) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 2);
      if (std::this_thread::get_id() == caller) on_caller = true;
      for (int64_t i; (i = next.fetch_add(1)) < 50;) done.fetch_add(1);
    });
    ASSERT_EQ(done.load(), 50);
    ASSERT_FALSE(on_caller.load());
  }
}

TEST(ThreadPool, PinningValidatesCpus) {
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int first = -1;
  for (int c = 0; c < CPU_SETSIZE && first < 0; ++c)
    if (CPU_ISSET(c, &allowed)) first = c;
  ASSERT_GE(first, 0);
  auto pool = ThreadPool::Create({.num_threads = 2, .cpus = {first}});
  ASSERT_OK(pool);
  std::vector<int> seen(2, -1);
  (*pool)->RunOnAll([&](int t) { seen[t] = sched_getcpu(); });
  EXPECT_EQ(seen[0], first);
  EXPECT_EQ(seen[1], first);
  EXPECT_EQ(ThreadPool::Create({.num_threads = 1, .cpus = {CPU_SETSIZE + 5}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ThreadPool::Create({.num_threads = 0}).ok());
}

TEST(Numa, TopologyAndNodeLocalAllocation) {
  auto topo = ProbeTopology();
  ASSERT_OK(topo);
  ASSERT_GE(topo->nodes.size(), 1u);
  std::set<int> all;
  for (const NumaNode& node : topo->nodes) all.insert(node.cpu_ids.begin(), node.cpu_ids.end());
  EXPECT_FALSE(all.empty());
  auto buf = AllocateOnNode(5 << 20, NodeAllocOptions{.node = 0, .huge_pages = true});
  ASSERT_OK(buf);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf->data()) % (2 << 20), 0u);
  EXPECT_GE(buf->size(), size_t{5} << 20);
  buf->data()[0] = 1;
  buf->data()[buf->size() - 1] = 2;
  EXPECT_EQ(buf->data()[buf->size() - 1], 2);
  EXPECT_FALSE(buf->page_mode().empty());
  NodeBuffer moved = std::move(*buf);
  EXPECT_EQ(moved.data()[0], 1);
}

}  // namespace
}  // namespace numoe
