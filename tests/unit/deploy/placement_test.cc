// PlaceWorkers, the one placement rule (deploy/placement.h), on described machines: the exact nodes,
// CPUs, threads and pinned CPUs of every worker in planner mode and in --workers N mode, and the errors.
// Every placement it makes must pass the worker's own check (worker/service/numa_bind.h).
#include "deploy/placement.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/service/numa_bind.h"

namespace numoe::deploy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int64_t kGB = 1'000'000'000;

// A node with CPU ids from a list such as "0-23,96-119"; cores 0 = unknown.
NumaNode Node(int id, const std::string& cpus, int cores = 0) {
  NumaNode n;
  n.id = id;
  n.cpu_ids = *ParseCpuList(cpus, "cpus");
  n.num_cpus = static_cast<int>(n.cpu_ids.size());
  n.cores = cores;
  n.memory_bytes = 192 * kGB;
  return n;
}

Topology Machine(std::vector<NumaNode> nodes) {
  Topology t;
  t.name = "described";
  t.nodes = std::move(nodes);
  return t;
}

// Planner mode: `need` per worker, `usable` per node (GB).
PlacementRequest ByMemory(int64_t need_gb, std::vector<int64_t> usable_gb, int threads = 0) {
  PlacementRequest r;
  r.need_bytes = need_gb * kGB;
  for (int64_t u : usable_gb) r.usable_bytes.push_back(u * kGB);
  r.threads_per_worker = threads;
  return r;
}

PlacementRequest ByCount(int workers, int threads = 0) {
  return PlacementRequest{.workers = workers, .threads_per_worker = threads};
}

std::vector<WorkerPlacement> Place(const Topology& t, const PlacementRequest& r) {
  auto placed = PlaceWorkers(t, r);
  EXPECT_TRUE(placed.ok()) << placed.status();
  if (!placed.ok()) return {};
  for (const WorkerPlacement& w : *placed) {
    EXPECT_TRUE(worker::ValidatePlacement(w, t).ok()) << "worker " << w.index << ": " << worker::ValidatePlacement(w, t);
  }
  return *placed;
}

std::string ErrorOf(const Topology& t, const PlacementRequest& r) {
  auto placed = PlaceWorkers(t, r);
  EXPECT_FALSE(placed.ok());
  return placed.ok() ? "" : std::string(placed.status().message());
}

std::string Cpus(const std::vector<int>& cpus) { return FormatCpuList(cpus); }

TEST(PlaceWorkers, OneNodeFewCpus) {
  const Topology t = Machine({Node(0, "0-3")});
  for (const PlacementRequest& r : {ByMemory(100, {180}), ByCount(1)}) {
    auto w = Place(t, r);
    ASSERT_EQ(w.size(), 1u);
    EXPECT_EQ(w[0].index, 0);
    EXPECT_THAT(w[0].nodes, ElementsAre(0));
    EXPECT_FALSE(w[0].interleaved());
    EXPECT_THAT(w[0].cpus, ElementsAre(0, 1, 2, 3));
    EXPECT_EQ(w[0].threads, 4);  // cores unknown: one per logical CPU
    EXPECT_THAT(w[0].thread_cpus, ElementsAre(0, 1, 2, 3));
  }
}

TEST(PlaceWorkers, TwoSmtNodesOneWorkerPerCore) {
  const Topology t = Machine({Node(0, "0-23,96-119", 24), Node(1, "24-47,120-143", 24)});
  for (const PlacementRequest& r : {ByMemory(160, {184, 184}), ByCount(2)}) {
    auto w = Place(t, r);
    ASSERT_EQ(w.size(), 2u);
    EXPECT_THAT(w[0].nodes, ElementsAre(0));
    EXPECT_EQ(Cpus(w[0].cpus), "0-23,96-119");
    EXPECT_EQ(w[0].threads, 24);
    EXPECT_EQ(Cpus(w[0].thread_cpus), "0-23");  // one hardware thread of every core
    EXPECT_THAT(w[1].nodes, ElementsAre(1));
    EXPECT_EQ(Cpus(w[1].cpus), "24-47,120-143");
    EXPECT_EQ(Cpus(w[1].thread_cpus), "24-47");
  }
}

TEST(PlaceWorkers, ManyCpusSplitIntoSlotsKeepingSiblingsTogether) {
  const Topology t = Machine({Node(0, "0-23,96-119", 24)});
  PlacementRequest r = ByMemory(40, {184});
  r.instances_per_node = 4;
  auto w = Place(t, r);
  ASSERT_EQ(w.size(), 4u);
  const char* want[] = {"0-5,96-101", "6-11,102-107", "12-17,108-113", "18-23,114-119"};
  const char* threads_on[] = {"0-5", "6-11", "12-17", "18-23"};
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(w[k].slot, k);
    EXPECT_EQ(w[k].slots, 4);
    EXPECT_EQ(Cpus(w[k].cpus), want[k]);
    EXPECT_EQ(w[k].threads, 6);
    EXPECT_EQ(Cpus(w[k].thread_cpus), threads_on[k]);
    EXPECT_EQ(w[k].usable_bytes, 46 * kGB);
  }
}

TEST(PlaceWorkers, FourSmallNodesPairByDistance) {
  // Node 0's nearest is node 2 (and 1's is 3): the pairs follow the distances, not the ids.
  Topology t = Machine({Node(0, "0-3"), Node(1, "4-7"), Node(2, "8-11"), Node(3, "12-15")});
  t.distances = {{10, 30, 20, 30}, {30, 10, 30, 20}, {20, 30, 10, 30}, {30, 20, 30, 10}};
  auto w = Place(t, ByMemory(100, {60, 60, 60, 60}));
  ASSERT_EQ(w.size(), 2u);
  EXPECT_THAT(w[0].nodes, ElementsAre(0, 2));
  EXPECT_TRUE(w[0].interleaved());
  EXPECT_EQ(Cpus(w[0].cpus), "0-3,8-11");
  EXPECT_EQ(w[0].threads, 8);
  EXPECT_EQ(Cpus(w[0].thread_cpus), "0-3,8-11");
  EXPECT_EQ(w[0].usable_bytes, 120 * kGB);
  EXPECT_THAT(w[1].nodes, ElementsAre(1, 3));
  EXPECT_EQ(Cpus(w[1].cpus), "4-7,12-15");
}

TEST(PlaceWorkers, MemoryTooSmallForACopySpansNodesInterleaved) {
  // Three nodes of 40 GB usable hold one 100 GB worker only together; a fourth, lone node is left out.
  const Topology t = Machine({Node(0, "0-1"), Node(1, "2-3"), Node(2, "4-5"), Node(3, "6-7")});
  auto w = Place(t, ByMemory(100, {40, 40, 40, 10}));
  ASSERT_EQ(w.size(), 1u);
  EXPECT_THAT(w[0].nodes, ElementsAre(0, 1, 2));
  EXPECT_EQ(w[0].NumactlArgs(), "--cpunodebind=0,1,2 --interleave=0,1,2");
  EXPECT_EQ(Cpus(w[0].thread_cpus), "0-5");
  // Not even all nodes together: no worker, and no error (the planner reports the shortfall).
  auto none = PlaceWorkers(t, ByMemory(200, {40, 40, 40, 10}));
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
}

TEST(PlaceWorkers, FewerWorkersThanNodesTakeTheFirstNodes) {
  const Topology t = Machine({Node(0, "0-3"), Node(1, "4-7"), Node(2, "8-11"), Node(3, "12-15")});
  auto w = Place(t, ByCount(2));
  ASSERT_EQ(w.size(), 2u);
  EXPECT_THAT(w[0].nodes, ElementsAre(0));
  EXPECT_THAT(w[0].thread_cpus, ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(w[1].nodes, ElementsAre(1));
  EXPECT_THAT(w[1].thread_cpus, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(w[1].slots, 1);
  EXPECT_EQ(w[1].need_bytes, 0);  // --workers N does not check memory
}

TEST(PlaceWorkers, MoreWorkersThanNodesRoundRobinWithDisjointShares) {
  const Topology t = Machine({Node(0, "0-3,8-11", 4), Node(1, "4-7,12-15", 4)});
  auto w = Place(t, ByCount(5));
  ASSERT_EQ(w.size(), 5u);
  // Node 0 runs workers 0, 2, 4 (slots 1-3 of 3), node 1 workers 1, 3.
  const std::vector<int> node = {0, 1, 0, 1, 0};
  const char* cpus[] = {"0-1,8-9", "4-5,12-13", "2,10", "6-7,14-15", "3,11"};
  const char* threads_on[] = {"0-1", "4-5", "2", "6-7", "3"};
  const int threads[] = {2, 2, 1, 2, 1};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(w[i].index, i);
    EXPECT_THAT(w[i].nodes, ElementsAre(node[i])) << i;
    EXPECT_EQ(w[i].slot, i / 2) << i;
    EXPECT_EQ(w[i].slots, node[i] == 0 ? 3 : 2) << i;
    EXPECT_EQ(Cpus(w[i].cpus), cpus[i]) << i;
    EXPECT_EQ(w[i].threads, threads[i]) << i;
    EXPECT_EQ(Cpus(w[i].thread_cpus), threads_on[i]) << i;
  }
}

TEST(PlaceWorkers, MoreWorkersThanCpusShareOneCpuEach) {
  const Topology t = Machine({Node(0, "0-1")});
  auto w = Place(t, ByCount(3, 1));
  ASSERT_EQ(w.size(), 3u);
  EXPECT_THAT(w[0].thread_cpus, ElementsAre(0));
  EXPECT_THAT(w[1].thread_cpus, ElementsAre(1));
  EXPECT_THAT(w[2].thread_cpus, ElementsAre(0));
  for (const WorkerPlacement& x : w) EXPECT_EQ(x.threads, 1);
}

TEST(PlaceWorkers, ThreadsPerWorkerPinsTheFirstCpusAndIsCheckedAgainstThem) {
  const Topology t = Machine({Node(0, "0-3"), Node(1, "4-7")});
  // Two threads on node 1: its first two CPUs.
  auto w = Place(t, ByCount(2, 2));
  ASSERT_EQ(w.size(), 2u);
  EXPECT_THAT(w[1].nodes, ElementsAre(1));
  EXPECT_THAT(w[1].cpus, ElementsAre(4, 5, 6, 7));
  EXPECT_EQ(w[1].threads, 2);
  EXPECT_THAT(w[1].thread_cpus, ElementsAre(4, 5));
  EXPECT_THAT(Place(t, ByMemory(100, {180, 180}, 3))[0].thread_cpus, ElementsAre(0, 1, 2));
  EXPECT_THAT(ErrorOf(t, ByCount(2, 5)),
              HasSubstr("--threads-per-worker 5: worker 0 (node 0) has only 4 CPUs (0-3); give at most 4"));
  PlacementRequest bench = ByCount(4, 3);
  bench.threads_flag = "--threads";
  EXPECT_THAT(ErrorOf(t, bench), HasSubstr("--threads 3: worker 0 (node 0, slot 1 of 2) has only 2 CPUs (0-1)"));
}

TEST(PlaceWorkers, CpuIdsUnknownLeaveCpusToTheNodes) {
  Topology t = Machine({Node(0, "0-47", 24)});
  t.nodes[0].cpu_ids.clear();  // "cpus": 48 in a JSON description
  auto w = Place(t, ByCount(2));
  ASSERT_EQ(w.size(), 2u);
  EXPECT_TRUE(w[0].cpus.empty());
  EXPECT_TRUE(w[0].thread_cpus.empty());
  EXPECT_EQ(w[0].threads, 12);  // 24 logical CPUs each, 12 cores
  EXPECT_EQ(w[0].NumactlArgs(), "--cpunodebind=0 --membind=0");
  EXPECT_EQ(Place(t, ByCount(1, 30))[0].threads, 30);  // nothing to check the count against
}

TEST(PlaceWorkers, RefusesBadRequestsByName) {
  const Topology t = Machine({Node(0, "0-3"), Node(1, "4-7")});
  EXPECT_THAT(ErrorOf(t, ByCount(-1)), HasSubstr("--workers must be in [0, 4096] (got -1)"));
  EXPECT_THAT(ErrorOf(t, ByCount(1, -2)), HasSubstr("--threads-per-worker must be >= 0 (got -2)"));
  EXPECT_THAT(ErrorOf(t, ByMemory(0, {10, 10})), HasSubstr("a worker's need must be > 0 bytes"));
  EXPECT_THAT(ErrorOf(t, ByMemory(10, {10})), HasSubstr("1 usable sizes for 2 nodes"));
  PlacementRequest many = ByMemory(10, {100, 100});
  many.instances_per_node = 11;
  EXPECT_THAT(ErrorOf(t, many), HasSubstr("--instances-per-node 11: node 0 holds only 10 workers"));
  many.instances_per_node = 5;
  EXPECT_THAT(ErrorOf(t, many), HasSubstr("--instances-per-node 5: node 0 has only 4 CPUs"));
  Topology empty_node = t;
  empty_node.nodes[1].cpu_ids.clear();
  empty_node.nodes[1].num_cpus = 0;  // a node without CPUs cannot run a worker
  EXPECT_THAT(ErrorOf(empty_node, ByCount(2)), HasSubstr("nodes[1].cpus must be > 0"));
}

}  // namespace
}  // namespace numoe::deploy
