// Placement rules and printed arithmetic of the deploy planner on described machines with the full-size
// V4-Flash-0731 model. Expected numbers are worked out by hand from the model's shape
// (full_size_model.h) and the documented defaults (deploy/planner.h), never taken from the code's output.
#include "deploy/planner.h"

#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/unit/deploy/full_size_model.h"
#include "tests/support/status_matchers.h"

namespace numoe::deploy {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::Described;
using testing::FullSizeModel;

// Per-worker terms with the defaults (GB = 1e9 B):
//   routed experts   147,169,738,752                         147.17 GB
//   DSpark drafter    10,267,656,192 (3 x 256 experts)         10.27 GB
//   repack 2% of 157,437,394,944 = 3,148,747,898.88 -> ceil     3.15 GB
//   activations 2 x 8192 x 131,120 + 1e9 = 3,148,270,080        3.15 GB
//   one worker       163,734,412,923                          163.73 GB
//   + 8 GB OS headroom per node -> a node needs               171.73 GB
constexpr int64_t kRepack = 3'148'747'899;
constexpr int64_t kActivations = 3'148'270'080;
constexpr int64_t kNeed = 163'734'412'923;

// The text with every run of whitespace collapsed to one space: asserts read the numbers and words in
// order without depending on column alignment or line wrapping.
std::string Flat(const std::string& text) {
  std::string out;
  for (char c : text) {
    bool space = c == ' ' || c == '\n' || c == '\t';
    if (space && (out.empty() || out.back() == ' ')) continue;
    out += space ? ' ' : c;
  }
  return out;
}

std::vector<std::vector<int>> NodesOf(const Plan& plan) {
  std::vector<std::vector<int>> out;
  for (const auto& w : plan.workers) out.push_back(w.nodes);
  return out;
}

Plan MustPlan(const Topology& t, const PlanOptions& options = {}) {
  auto plan = MakePlan(t, FullSizeModel(), options);
  EXPECT_OK(plan);
  return plan.ok() ? *plan : Plan{};
}

TEST(PlannerTerms, FullSizeArithmetic) {
  ModelMemory m = FullSizeModel();
  EXPECT_EQ(m.routed_expert_bytes, 147'169'738'752);
  EXPECT_EQ(m.drafter_expert_bytes, 10'267'656'192);
  EXPECT_EQ(WorkerActivationBytesPerToken(4096, 2048, 6), 131'120);
  Plan plan = MustPlan(Described("one", {{192, 6, 24}}));
  ASSERT_EQ(plan.terms.size(), 4u);
  EXPECT_EQ(plan.terms[0].bytes, 147'169'738'752);
  EXPECT_EQ(plan.terms[1].bytes, 10'267'656'192);
  EXPECT_EQ(plan.terms[2].bytes, kRepack);
  EXPECT_EQ(plan.terms[3].bytes, kActivations);
  EXPECT_EQ(plan.worker_need_bytes, kNeed);
  EXPECT_TRUE(plan.drafter_on_cpu);

  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("routed experts"));
  EXPECT_THAT(text, HasSubstr("147.17 GB 43 layers x 256 experts x 13.37 MB (MXFP4, as stored)"));
  EXPECT_THAT(text, HasSubstr("DSpark drafter experts"));
  EXPECT_THAT(text, HasSubstr("10.27 GB 3 stages x 256 experts, in every worker"));
  EXPECT_THAT(text, HasSubstr("3.15 GB 2% of 157.44 GB"));
  EXPECT_THAT(text, HasSubstr("3.15 GB 2 micro-batches x 8192 tokens x 131120 B + 1.00 GB fixed"));
  EXPECT_THAT(text, HasSubstr("= one worker 163.73 GB"));
  EXPECT_THAT(text, HasSubstr("OS headroom per node 8.00 GB"));
  EXPECT_THAT(text, HasSubstr("= a node holds a copy with 171.73 GB"));
  // The bandwidth bound: 3.45 GB per token; 6 x DDR4-2933 = 140.8 GB/s -> 40.8 tok/s.
  EXPECT_THAT(text, HasSubstr("reads 3.45 GB of routed experts (top-6 of 256 experts in each of 43 layers)"));
  EXPECT_THAT(text, HasSubstr("140.8 GB/s: 40.8 tok/s"));
}

TEST(PlannerTerms, DrafterOnGpuOrAbsent) {
  PlanOptions gpu;
  gpu.drafter_experts = DrafterExperts::kGpu;
  Plan plan = MustPlan(Described("one", {{192, 6, 24}}), gpu);
  EXPECT_FALSE(plan.drafter_on_cpu);
  EXPECT_EQ(plan.terms[1].bytes, 0);
  // repack: 2% of 147,169,738,752 = 2,943,394,775.04 -> 2,943,394,776.
  EXPECT_EQ(plan.terms[2].bytes, 2'943'394'776);
  EXPECT_EQ(plan.worker_need_bytes, 147'169'738'752 + 2'943'394'776 + kActivations);
  EXPECT_THAT(Flat(FormatPlanText(plan)), HasSubstr("on the GPU (--drafter-experts gpu): 10.27 GB in numoe-gpu instead"));

  ModelMemory no_drafter = FullSizeModel();
  no_drafter.drafter_expert_bytes = 0;
  auto p2 = MakePlan(Described("one", {{192, 6, 24}}), no_drafter, PlanOptions{});
  ASSERT_OK(p2);
  EXPECT_FALSE(p2->drafter_on_cpu);
  EXPECT_EQ(p2->terms[1].bytes, 0);
  EXPECT_THAT(Flat(FormatPlanText(*p2)), HasSubstr("the model has no drafter experts"));
}

TEST(PlannerTerms, OptionsChangeTheArithmetic) {
  PlanOptions o;
  o.repack_overhead = 0.0;
  o.max_batch_tokens = 1024;
  o.micro_batches = 1;
  o.fixed_buffer_bytes = 0;
  o.os_headroom_bytes = 2'000'000'000;
  Plan plan = MustPlan(Described("one", {{192, 6, 24}}), o);
  EXPECT_EQ(plan.terms[2].bytes, 0);
  EXPECT_EQ(plan.terms[3].bytes, 1024 * 131'120);
  EXPECT_EQ(plan.worker_need_bytes, 147'169'738'752 + 10'267'656'192 + 1024 * 131'120);
  EXPECT_EQ(plan.nodes[0].usable_bytes, 190'000'000'000);
}

// A small box keeps 10% for the OS, not 8 GB: a 7.5 GB VM (one node, 2 CPUs) runs a ~1 GB worker.
TEST(PlannerTerms, SmallMachinesKeepAFractionForTheOs) {
  ModelMemory small = FullSizeModel();
  small.routed_expert_bytes = 100'000'000;
  small.drafter_expert_bytes = 0;
  small.activation_bytes_per_token = 2064;
  auto plan = MakePlan(Described("vm", {{7.5, 0, 2}}), small, PlanOptions{});
  ASSERT_OK(plan);
  // need = 100 MB + 2 MB repack + (2 x 8192 x 2064 + 1e9) = 1,135,816,576 B; headroom = 750 MB.
  EXPECT_EQ(plan->worker_need_bytes, 1'135'816'576);
  EXPECT_EQ(plan->nodes[0].headroom_bytes, 750'000'000);
  EXPECT_EQ(plan->nodes[0].usable_bytes, 6'750'000'000);
  ASSERT_EQ(plan->workers.size(), 1u);
  EXPECT_EQ(plan->nodes[0].copies_fit, 5);
  // The smallest node for one worker: need / 0.9 (the 10% is below 8 GB there) = 1,262,018,418 B (rounded up).
  EXPECT_EQ(plan->node_bytes_for_one_worker, 1'262'018'418);
  EXPECT_THAT(Flat(FormatPlanText(*plan)), HasSubstr("= a node holds a copy with 1.26 GB"));
  EXPECT_THAT(Flat(FormatPlanText(*plan)), HasSubstr("routed experts 100.00 MB"));
  EXPECT_THAT(Flat(FormatPlanText(*plan)), HasSubstr("6.75 GB usable after 750.00 MB OS headroom >= 1.14 GB"));
}

// 4 nodes x 192 GB (24 DIMMs of 32 GB): every node holds a copy; one worker each.
TEST(PlannerPlacement, FourNodes192GB24Dimms) {
  Plan plan = MustPlan(Described("4x192", {{192, 6, 0}, {192, 6, 0}, {192, 6, 0}, {192, 6, 0}}));
  ASSERT_TRUE(plan.fits());
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2), ElementsAre(3)));
  for (const auto& w : plan.workers) {
    EXPECT_EQ(w.need_bytes, kNeed);
    EXPECT_EQ(w.usable_bytes, 184'000'000'000);
    EXPECT_EQ(w.threads, 24);  // 24 cores, not 48 SMT threads
    EXPECT_EQ(w.slots, 1);
  }
  EXPECT_EQ(plan.workers[1].cpus.size(), 48u);
  EXPECT_EQ(FormatCpuList(plan.workers[1].thread_cpus), "24-47");  // one hardware thread of every core
  EXPECT_EQ(plan.workers[1].NumactlArgs(), "--cpunodebind=1 --membind=1");
  EXPECT_TRUE(plan.unused_nodes.empty());
  EXPECT_EQ(plan.shortfall_bytes, 0);
  for (const auto& n : plan.nodes) EXPECT_EQ(n.copies_fit, 1);

  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("4 NUMA nodes, 768.00 GB, 192 CPUs, 24 DIMMs"));
  EXPECT_THAT(text, HasSubstr("Plan: 4 workers"));
  EXPECT_THAT(text, HasSubstr("worker 0 node 0 24 threads 163.73 GB of 184.00 GB usable "
                              "numactl --cpunodebind=0 --membind=0"));
  EXPECT_THAT(text, HasSubstr(" 0 192.00 GB 184.00 GB 6 48 1 worker 0"));
  EXPECT_THAT(text, HasSubstr("Nodes 0, 1, 2, 3 (192.00 GB, 6 DIMMs each): 184.00 GB usable after 8.00 GB OS "
                              "headroom >= 163.73 GB. Each holds a copy and runs one worker bound to it"));
  EXPECT_THAT(text, HasSubstr("DIMMs: 24 (6 per node)."));
  EXPECT_THAT(text, Not(HasSubstr("interleaved")));
}

// 4 nodes x 128 GB (16 DIMMs): no node holds a copy (120 GB usable < 163.73 GB); pairs interleave.
TEST(PlannerPlacement, FourNodes128GB16Dimms) {
  Plan plan = MustPlan(Described("4x128", {{128, 4, 24}, {128, 4, 24}, {128, 4, 24}, {128, 4, 24}}));
  ASSERT_TRUE(plan.fits());
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0, 1), ElementsAre(2, 3)));
  for (const auto& w : plan.workers) {
    EXPECT_TRUE(w.interleaved());
    EXPECT_EQ(w.usable_bytes, 240'000'000'000);
    EXPECT_EQ(w.threads, 48);
    EXPECT_TRUE(w.cpus.empty());  // CPU ids not given: bind by node
  }
  EXPECT_EQ(plan.workers[1].NumactlArgs(), "--cpunodebind=2,3 --interleave=2,3");
  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("Plan: 2 workers"));
  EXPECT_THAT(text, HasSubstr("worker 1 nodes 2,3 interleaved 48 threads 163.73 GB of 240.00 GB usable "
                              "numactl --cpunodebind=2,3 --interleave=2,3"));
  // 163.73 - 120.00 = 43.73 GB short per node.
  EXPECT_THAT(text, HasSubstr("Nodes 0, 1 (128.00 GB, 4 DIMMs each) are too small alone (120.00 GB usable each < "
                              "163.73 GB: 43.73 GB short)"));
  EXPECT_THAT(text, HasSubstr("so together they run worker 0 with its memory interleaved over both (240.00 GB usable)"));
  EXPECT_THAT(text, HasSubstr("Nodes 2, 3 likewise run worker 1, interleaved over both (240.00 GB usable)."));
  // 171.73 GB per node / 4 DIMMs = 42.93 GB per DIMM -> 48 GB DIMMs.
  EXPECT_THAT(text, HasSubstr("DIMMs: 16 (4 per node). A node needs 171.73 GB to hold its own copy: with 4 DIMMs "
                              "per node, at least 42.93 GB each (e.g. 4 x 48 GB), which would run 4 node-local "
                              "workers instead of 2."));
}

// 192/192/160/160 GB (22 DIMMs: 6/6/5/5): the 160 GB nodes (152 GB usable) pair up; the node-local
// workers run as fast as on 24 DIMMs; the 2 missing DIMMs cost one instance.
TEST(PlannerPlacement, Uneven22Dimms) {
  Plan plan = MustPlan(Described("22dimm", {{192, 6, 24}, {192, 6, 24}, {160, 5, 24}, {160, 5, 24}}));
  ASSERT_TRUE(plan.fits());
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2, 3)));
  EXPECT_EQ(plan.workers[2].usable_bytes, 304'000'000'000);
  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("Plan: 3 workers"));
  EXPECT_THAT(text, HasSubstr(" 2 160.00 GB 152.00 GB 5 24 0 worker 2 (interleaved)"));
  EXPECT_THAT(text, HasSubstr("Nodes 2, 3 (160.00 GB, 5 DIMMs each) are too small alone (152.00 GB usable each < "
                              "163.73 GB: 11.73 GB short), so together they run worker 2"));
  EXPECT_THAT(text, HasSubstr("DIMMs: 22 (6/6/5/5 per node). The workers on nodes 0, 1 stream from nodes populated "
                              "like every node of a 24-DIMM machine (6 per node), so a stream there decodes as "
                              "fast as on 24 DIMMs. The 2 missing DIMMs cost instances, not per-stream speed: 3 "
                              "workers here, 4 with 6 DIMMs on every node."));
}

// 2 nodes x 768 GB: each could hold 4 copies (760 / 163.73 = 4.6) but runs one worker.
TEST(PlannerPlacement, TwoNodes768GB) {
  Plan plan = MustPlan(Described("2x768", {{768, 12, 0}, {768, 12, 0}}));
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0), ElementsAre(1)));
  EXPECT_EQ(plan.nodes[0].copies_fit, 4);
  EXPECT_EQ(plan.workers[0].usable_bytes, 760'000'000'000);
  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("Plan: 2 workers"));
  EXPECT_THAT(text, HasSubstr("Nodes 0, 1 could each hold 4 copies (760.00 GB / 163.73 GB) but run one worker"));
  EXPECT_THAT(text, HasSubstr("--instances-per-node N (up to 4 here)"));
}

TEST(PlannerPlacement, InstancesPerNodeOverride) {
  PlanOptions o;
  o.instances_per_node = 4;
  Plan plan = MustPlan(Described("2x768", {{768, 12, 0}, {768, 12, 0}}), o);
  ASSERT_EQ(plan.workers.size(), 8u);
  // Each node's 24 cores + 24 siblings split 4 ways with siblings kept together.
  EXPECT_EQ(plan.workers[0].nodes, std::vector<int>{0});
  EXPECT_EQ(plan.workers[0].slot, 0);
  EXPECT_EQ(plan.workers[3].slot, 3);
  EXPECT_EQ(plan.workers[4].nodes, std::vector<int>{1});
  EXPECT_EQ(FormatCpuList(plan.workers[0].cpus), "0-5,96-101");
  EXPECT_EQ(FormatCpuList(plan.workers[5].cpus), "30-35,126-131");
  EXPECT_EQ(plan.workers[5].threads, 6);
  EXPECT_EQ(FormatCpuList(plan.workers[5].thread_cpus), "30-35");
  EXPECT_EQ(plan.workers[5].usable_bytes, 190'000'000'000);
  EXPECT_EQ(plan.workers[5].NumactlArgs(), "--physcpubind=30-35,126-131 --membind=1");
  EXPECT_THAT(Flat(FormatPlanText(plan)), HasSubstr("runs 4 workers (--instances-per-node 4)"));

  // 5 per node does not fit 760 GB (5 x 163.73 = 818.67 GB): an error, never an over-full node.
  o.instances_per_node = 5;
  auto bad = MakePlan(Described("2x768", {{768, 12, 0}, {768, 12, 0}}), FullSizeModel(), o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("--instances-per-node 5: node 0 holds only 4 workers (760.00 GB usable, 5 x 163.73 GB = "
                        "818.67 GB needed)"));

  // Explicit 1 is the default; small nodes still pair under an override.
  o.instances_per_node = 1;
  Plan one = MustPlan(Described("22dimm", {{192, 6, 24}, {192, 6, 24}, {160, 5, 24}, {160, 5, 24}}), o);
  EXPECT_THAT(NodesOf(one), ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2, 3)));

  o.instances_per_node = 2;
  auto two = MakePlan(Described("4x192", {{192, 6, 24}, {192, 6, 24}}), FullSizeModel(), o);
  ASSERT_FALSE(two.ok());
  EXPECT_THAT(std::string(two.status().message()), HasSubstr("node 0 holds only 1 worker "));
}

// One node of 128 GB: 120 GB usable, 43.73 GB missing; without the drafter still 33.26 GB missing.
TEST(PlannerPlacement, TooSmallForOneCopy) {
  Plan plan = MustPlan(Described("small", {{128, 4, 16}}));
  EXPECT_FALSE(plan.fits());
  EXPECT_TRUE(plan.workers.empty());
  EXPECT_EQ(plan.shortfall_bytes, kNeed - 120'000'000'000);
  EXPECT_THAT(plan.unused_nodes, ElementsAre(0));
  const std::string text = Flat(FormatPlanText(plan));
  EXPECT_THAT(text, HasSubstr("Plan: no worker fits (43.73 GB missing)"));
  EXPECT_THAT(text, HasSubstr("a worker needs 163.73 GB, and its one node offers 120.00 GB usable (128.00 GB "
                              "minus 8.00 GB OS headroom): 43.73 GB missing."));
  // Drafter experts + their repack share: 10,267,656,192 + 205,353,124 = 10.47 GB; 43.73 - 10.47 = 33.26.
  EXPECT_THAT(text, HasSubstr("Even with the drafter's experts on the GPU (--drafter-experts gpu, saves 10.47 GB), "
                              "33.26 GB would be missing."));
  EXPECT_THAT(text, HasSubstr("Add at least 43.73 GB"));

  // Two 64 GB nodes keep 10% (6.4 GB < 8 GB) each: 57.6 + 57.6 = 115.2 GB usable, 48.53 GB missing.
  Plan two = MustPlan(Described("2x64", {{64, 2, 8}, {64, 2, 8}}));
  EXPECT_FALSE(two.fits());
  EXPECT_EQ(two.nodes[0].headroom_bytes, 6'400'000'000);
  EXPECT_EQ(two.shortfall_bytes, kNeed - 115'200'000'000);
  EXPECT_THAT(Flat(FormatPlanText(two)), HasSubstr("offer 115.20 GB usable (128.00 GB minus 12.80 GB OS headroom): "
                                                   "48.53 GB missing."));

  // 170 GB: short by less than the drafter: moving it to the GPU would fit.
  Plan near = MustPlan(Described("near", {{170, 0, 16}}));
  EXPECT_FALSE(near.fits());
  EXPECT_THAT(Flat(FormatPlanText(near)), HasSubstr("saves 10.47 GB per worker, enough for one worker here"));
}

TEST(PlannerPlacement, GroupsOfThreeAndUnusedNodes) {
  // 4 x 64 GB: 57.6 GB usable each; three make 172.8 GB >= 163.73 GB; the fourth stays unused.
  Plan plan = MustPlan(Described("4x64", {{64, 0, 8}, {64, 0, 8}, {64, 0, 8}, {64, 0, 8}}));
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0, 1, 2)));
  EXPECT_THAT(plan.unused_nodes, ElementsAre(3));
  EXPECT_EQ(plan.workers[0].NumactlArgs(), "--cpunodebind=0,1,2 --interleave=0,1,2");
  EXPECT_THAT(Flat(FormatPlanText(plan)), HasSubstr("Node 3 stays unused"));

  // A node that completes the copy with the first is preferred over a nearer one that does not:
  // 100+30 < 163.73 but 100+100 fits, so nodes 0 and 2 pair and node 1 is left over.
  Plan skip = MustPlan(Described("skip", {{108, 0, 8}, {38, 0, 8}, {108, 0, 8}}));
  EXPECT_THAT(NodesOf(skip), ElementsAre(ElementsAre(0, 2)));
  EXPECT_THAT(skip.unused_nodes, ElementsAre(1));
}

TEST(PlannerPlacement, PairsFollowNumaDistance) {
  // Sub-NUMA clustering: nodes 0 and 2 share a socket, as do 1 and 3.
  Topology t = Described("snc", {{128, 0, 24}, {128, 0, 24}, {128, 0, 24}, {128, 0, 24}});
  t.distances = {{10, 21, 11, 21}, {21, 10, 21, 11}, {11, 21, 10, 21}, {21, 11, 21, 10}};
  Plan plan = MustPlan(t);
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0, 2), ElementsAre(1, 3)));
}

TEST(PlannerPlacement, MixedSizesNumberWorkersInNodeOrder) {
  Plan plan = MustPlan(Described("mixed", {{128, 0, 8}, {192, 0, 8}, {128, 0, 8}, {192, 0, 8}}));
  EXPECT_THAT(NodesOf(plan), ElementsAre(ElementsAre(0, 2), ElementsAre(1), ElementsAre(3)));
  for (size_t i = 0; i < plan.workers.size(); ++i) EXPECT_EQ(plan.workers[i].index, static_cast<int>(i));
  EXPECT_THAT(plan.nodes[2].workers, ElementsAre(0));
}

// Whatever the machine: no worker exceeds its nodes' usable memory, no node serves two groups, and by
// default no node runs two workers; nodes left out cannot make a copy together.
TEST(PlannerPlacement, InvariantsOnRandomMachines) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> count(1, 8);
  std::uniform_int_distribution<int> gb(16, 1024);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<testing::NodeSpec> specs;
    int n = count(rng);
    for (int i = 0; i < n; ++i) specs.push_back({static_cast<double>(gb(rng)), 0, 4});
    Topology t = Described("random", specs);
    Plan plan = MustPlan(t);
    std::vector<int> uses(n, 0);
    for (const auto& w : plan.workers) {
      int64_t usable = 0;
      for (int id : w.nodes) {
        usable += plan.nodes[t.IndexOf(id)].usable_bytes;
        ++uses[t.IndexOf(id)];
      }
      EXPECT_LE(w.need_bytes, usable);
      EXPECT_EQ(w.need_bytes, kNeed);
      if (w.interleaved()) {
        for (int id : w.nodes) EXPECT_LT(plan.nodes[t.IndexOf(id)].usable_bytes, kNeed) << "a node that fits alone was grouped";
      }
    }
    int64_t unused_usable = 0;
    for (int i = 0; i < n; ++i) {
      EXPECT_LE(uses[i], 1) << "trial " << trial;
      if (uses[i] == 0) unused_usable += plan.nodes[i].usable_bytes;
    }
    EXPECT_LT(unused_usable, kNeed);
    EXPECT_EQ(plan.fits(), plan.shortfall_bytes == 0);
  }
}

TEST(PlannerPlacement, AvailableMemory) {
  Topology t = Described("busy", {{192, 6, 24}, {192, 6, 24}});
  t.nodes[1].available_bytes = 100'000'000'000;
  // Planned on installed memory: two workers, with a warning about node 1.
  Plan plan = MustPlan(t);
  EXPECT_EQ(plan.workers.size(), 2u);
  ASSERT_EQ(plan.warnings.size(), 1u);
  EXPECT_THAT(plan.warnings[0], HasSubstr("node 1: only 100.00 GB available now, but its worker needs 163.73 GB"));
  // Planned on what is available: node 1 cannot hold a copy and has no partner.
  PlanOptions o;
  o.plan_on_available = true;
  Plan now = MustPlan(t, o);
  EXPECT_THAT(NodesOf(now), ElementsAre(ElementsAre(0)));
  EXPECT_EQ(now.nodes[1].usable_bytes, 100'000'000'000);
  EXPECT_THAT(now.unused_nodes, ElementsAre(1));
}

TEST(PlannerJson, WorkersAndTerms) {
  Plan plan = MustPlan(Described("22dimm", {{192, 6, 24}, {192, 6, 24}, {160, 5, 24}, {160, 5, 24}}));
  auto j = nlohmann::json::parse(FormatPlanJson(plan));
  ASSERT_EQ(j["workers"].size(), 3u);
  EXPECT_EQ(j["workers"][0]["nodes"], nlohmann::json::array({0}));
  EXPECT_EQ(j["workers"][2]["nodes"], nlohmann::json::array({2, 3}));
  EXPECT_EQ(j["workers"][2]["interleaved"], true);
  EXPECT_DOUBLE_EQ(j["workers"][2]["need_gb"].get<double>(), 163.73);
  EXPECT_EQ(j["workers"][2]["threads"], 48);
  EXPECT_FALSE(j["workers"][2].contains("thread_cpus"));  // CPU ids not given: nothing to pin
  EXPECT_EQ(j["workers"][2]["numactl"], "--cpunodebind=2,3 --interleave=2,3");
  EXPECT_DOUBLE_EQ(j["need_gb"].get<double>(), 163.73);
  EXPECT_EQ(j["need_bytes"], kNeed);
  ASSERT_EQ(j["terms"].size(), 4u);
  EXPECT_EQ(j["terms"][0]["key"], "routed_experts");
  EXPECT_EQ(j["terms"][0]["bytes"], 147'169'738'752);
  EXPECT_DOUBLE_EQ(j["terms"][1]["gb"].get<double>(), 10.27);
  EXPECT_EQ(j["drafter_experts"], "cpu");
  EXPECT_EQ(j["fits"], true);
  EXPECT_DOUBLE_EQ(j["missing_gb"].get<double>(), 0.0);
  EXPECT_EQ(j["topology"]["nodes"][3]["dimms"], 5);
  EXPECT_FALSE(j["explanation"].empty());

  Plan small = MustPlan(Described("small", {{128, 4, 16}}));
  auto s = nlohmann::json::parse(FormatPlanJson(small));
  EXPECT_EQ(s["fits"], false);
  EXPECT_TRUE(s["workers"].empty());
  EXPECT_DOUBLE_EQ(s["missing_gb"].get<double>(), 43.73);
}

TEST(PlannerErrors, BadInputsNameTheProblem) {
  Topology t = Described("one", {{192, 6, 24}});
  ModelMemory empty;
  empty.name = "empty";
  auto r = MakePlan(t, empty, PlanOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("routed expert bytes must be > 0"));

  PlanOptions o;
  o.repack_overhead = 1.5;
  r = MakePlan(t, FullSizeModel(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("repack overhead must be in [0, 1]"));

  o = PlanOptions{};
  o.max_batch_tokens = 0;
  r = MakePlan(t, FullSizeModel(), o);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("--max-batch-tokens"));

  r = MakePlan(Topology{}, FullSizeModel(), PlanOptions{});
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("nodes must list at least one NUMA node"));
}

TEST(PlannerProbe, ThisMachinePlansOrSaysWhatIsMissing) {
  // Whatever this machine is, the probe yields a valid topology and the planner a plan or a clear no.
  auto topo = ProbeTopology();
  ASSERT_OK(topo);
  ASSERT_FALSE(topo->nodes.empty());
  for (const auto& n : topo->nodes) {
    EXPECT_GT(n.memory_bytes, 0);
    EXPECT_GT(n.num_cpus, 0);
    EXPECT_EQ(n.cpu_ids.size(), static_cast<size_t>(n.num_cpus));
  }
  // A tiny model fits anywhere; the full-size one almost never fits a CI machine.
  ModelMemory tiny = FullSizeModel();
  tiny.routed_expert_bytes = 1'000'000;
  tiny.drafter_expert_bytes = 0;
  PlanOptions o;
  o.os_headroom_bytes = 0;
  o.fixed_buffer_bytes = 0;
  o.max_batch_tokens = 1;
  auto plan = PlanForThisMachine(tiny, o);
  ASSERT_OK(plan);
  EXPECT_EQ(plan->workers.size(), topo->nodes.size());

  o = PlanOptions{};
  ModelMemory huge = FullSizeModel();
  huge.routed_expert_bytes = int64_t{900'000} * 1'000'000'000;  // 900 TB
  auto no = PlanForThisMachine(huge, o);
  ASSERT_FALSE(no.ok());
  EXPECT_EQ(no.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(no.status().message()), HasSubstr("missing"));
}

}  // namespace
}  // namespace numoe::deploy
