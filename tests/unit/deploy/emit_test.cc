// systemd units and the Kubernetes manifest carry the plan's bindings, and writing them is safe.
#include "deploy/emit.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "gmock/gmock.h"
#include "gpu_service/gpu_flags.h"
#include "gtest/gtest.h"
#include "router/router_flags.h"
#include "tests/unit/deploy/full_size_model.h"
#include "worker/service/worker_flags.h"
#include "tests/support/files.h"
#include "tests/support/status_matchers.h"

namespace numoe::deploy {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::Described;
using testing::FullSizeModel;

namespace fs = std::filesystem;

// 192/192/160/160: workers on node 0, node 1, and nodes 2+3 interleaved (CPU ids listed: 24 cores + SMT).
Plan UnevenPlan(int instances = 0) {
  PlanOptions o;
  o.instances_per_node = instances;
  auto plan = MakePlan(Described("22dimm", {{192, 6, 0}, {192, 6, 0}, {160, 5, 0}, {160, 5, 0}}), FullSizeModel(), o);
  EXPECT_OK(plan);
  return *plan;
}

const EmittedFile* Find(const std::vector<EmittedFile>& files, const std::string& name) {
  for (const auto& f : files) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

// The words of a unit's ExecStart= line.
std::vector<std::string> ExecStart(const std::string& unit) {
  const size_t at = unit.find("\nExecStart=");
  EXPECT_NE(at, std::string::npos) << unit;
  if (at == std::string::npos) return {};
  const size_t begin = at + 11, end = unit.find('\n', begin);
  auto words = SplitExecStart(unit.substr(begin, end - begin));
  EXPECT_TRUE(words.ok()) << words.status();
  return words.ok() ? *words : std::vector<std::string>{};
}

// The daemon's own words after its binary (`name`) in `words`, parsed with its own flags into `config`.
template <typename Config, typename AddFlags>
Config ParseDaemon(const std::vector<std::string>& words, const std::string& name, AddFlags add_flags) {
  Config config;
  size_t bin = 0;
  while (bin < words.size() && fs::path(words[bin]).filename() != name) ++bin;
  EXPECT_LT(bin, words.size()) << name << " not in the command";
  std::vector<std::string> argv(words.begin() + static_cast<std::ptrdiff_t>(std::min(bin, words.size())),
                                words.end());
  std::vector<char*> ptrs;
  for (auto& w : argv) ptrs.push_back(w.data());
  ArgParser p(name, "");
  add_flags(p, &config);
  const Status st = p.Parse(static_cast<int>(ptrs.size()), ptrs.data());
  EXPECT_TRUE(st.ok()) << name << ": " << st;
  return config;
}

worker::WorkerAppConfig WorkerOf(const std::string& unit) {
  return ParseDaemon<worker::WorkerAppConfig>(ExecStart(unit), "numoe-worker", worker::AddWorkerFlags);
}
gpu::GpuAppConfig GpuOf(const std::string& unit) {
  return ParseDaemon<gpu::GpuAppConfig>(ExecStart(unit), "numoe-gpu", gpu::AddGpuFlags);
}
router::RouterAppConfig RouterOf(const std::string& unit) {
  return ParseDaemon<router::RouterAppConfig>(ExecStart(unit), "numoe-router", router::AddRouterFlags);
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

TEST(EmitSystemd, OneUnitPerProcessWithBindings) {
  EmitOptions o;
  o.launch.model_dir = "/models/DeepSeek-V4-Flash-0731";
  auto files = RenderSystemd(UnevenPlan(), o);
  ASSERT_OK(files);
  ASSERT_EQ(files->size(), 6u);  // gpu, 3 workers, router, target
  for (const char* name : {"numoe-gpu.service", "numoe-worker-0.service", "numoe-worker-1.service",
                           "numoe-worker-2.service", "numoe-router.service", "numoe.target"}) {
    ASSERT_NE(Find(*files, name), nullptr) << name;
  }
  const std::string w0 = Find(*files, "numoe-worker-0.service")->content;
  EXPECT_THAT(w0, HasSubstr("ExecStart=/usr/bin/numactl --cpunodebind=0 --membind=0 /usr/local/bin/numoe-worker "
                            "--model /models/DeepSeek-V4-Flash-0731 "));
  // What numoe-worker itself makes of the command: its own flags parse it.
  const worker::WorkerAppConfig wc0 = WorkerOf(w0);
  EXPECT_EQ(wc0.model_dir, "/models/DeepSeek-V4-Flash-0731");
  EXPECT_EQ(wc0.gpu_address, "127.0.0.1:50051");
  EXPECT_EQ(wc0.port, 50061);
  EXPECT_EQ(wc0.numa_nodes, std::vector<int>{0});
  EXPECT_FALSE(wc0.no_numa_bind);
  EXPECT_EQ(wc0.threads, 24);
  EXPECT_THAT(w0, HasSubstr("CPUAffinity=0-23,96-119\n"));
  EXPECT_THAT(w0, HasSubstr("NUMAPolicy=bind\nNUMAMask=0\n"));
  EXPECT_THAT(w0, HasSubstr("numoe-worker --help"));  // the flags are not final: say where they come from
  EXPECT_THAT(w0, HasSubstr("Needs 163.73 GB of its 184.00 GB usable"));
  EXPECT_THAT(w0, HasSubstr("WantedBy=numoe.target"));

  const std::string w2 = Find(*files, "numoe-worker-2.service")->content;
  EXPECT_THAT(w2, HasSubstr("numactl --cpunodebind=2,3 --interleave=2,3 /usr/local/bin/numoe-worker"));
  EXPECT_THAT(w2, HasSubstr("--numa-node 2,3 --threads 48"));
  EXPECT_THAT(w2, HasSubstr("--port 50063"));
  EXPECT_THAT(w2, HasSubstr("NUMAPolicy=interleave\nNUMAMask=2,3\n"));
  EXPECT_THAT(w2, HasSubstr("CPUAffinity=48-95,144-191\n"));

  const std::string gpu = Find(*files, "numoe-gpu.service")->content;
  EXPECT_THAT(gpu, HasSubstr("numactl --cpunodebind=0 --preferred=0 /usr/local/bin/numoe-gpu --model "
                             "/models/DeepSeek-V4-Flash-0731"));
  EXPECT_EQ(GpuOf(gpu).port, 50051);
  EXPECT_EQ(GpuOf(gpu).backend, Backend::kCpu);
  const std::string router = Find(*files, "numoe-router.service")->content;
  EXPECT_THAT(router, HasSubstr("--workers 127.0.0.1:50061,127.0.0.1:50062,127.0.0.1:50063"));
  EXPECT_EQ(RouterOf(router).router.balancer.workers,
            (std::vector<std::string>{"127.0.0.1:50061", "127.0.0.1:50062", "127.0.0.1:50063"}));
  const std::string target = Find(*files, "numoe.target")->content;
  EXPECT_THAT(target, HasSubstr("Wants=numoe-gpu.service numoe-worker-0.service numoe-worker-1.service "
                                "numoe-worker-2.service numoe-router.service"));
}

TEST(EmitSystemd, SeveralPerNodeArePinnedToTheirCpus) {
  auto plan = MakePlan(Described("2x768", {{768, 12, 0}, {768, 12, 0}}), FullSizeModel(),
                       PlanOptions{.instances_per_node = 2});
  ASSERT_OK(plan);
  auto files = RenderSystemd(*plan, EmitOptions{});
  ASSERT_OK(files);
  const std::string w1 = Find(*files, "numoe-worker-1.service")->content;
  EXPECT_THAT(w1, HasSubstr("numactl --physcpubind=12-23,108-119 --membind=0 /usr/local/bin/numoe-worker"));
  EXPECT_THAT(w1, HasSubstr("--numa-node 0 --threads 12"));
  EXPECT_THAT(w1, HasSubstr("CPUAffinity=12-23,108-119"));
}

TEST(EmitSystemd, QuotesAndEscapesPaths) {
  EmitOptions o;
  o.launch.model_dir = "/models/my model 100% \"$HOME\"";
  auto files = RenderSystemd(UnevenPlan(), o);
  ASSERT_TRUE(files.ok());
  EXPECT_THAT(Find(*files, "numoe-worker-0.service")->content,
              HasSubstr("--model \"/models/my model 100%% \\\"$$HOME\\\"\""));
  // And the daemon reads the path back as it was.
  EXPECT_EQ(WorkerOf(Find(*files, "numoe-worker-0.service")->content).model_dir, o.launch.model_dir);
}

// Every unit's ExecStart parses with its daemon's own flags, carries the launch options (backend, spec,
// drafter experts, simulated experts) and wires the daemons to each other's addresses.
TEST(EmitSystemd, EveryExecStartParsesWithTheDaemonsOwnFlags) {
  EmitOptions o;
  o.launch.model_dir = "/models/v4";
  o.launch.backend = Backend::kCuda;
  o.launch.spec = SpecChoice::kDspark;
  o.launch.spec_depth = 3;
  o.launch.drafter_experts = DrafterExperts::kGpu;
  o.launch.max_seqs = 300;
  o.launch.gpus = {1, 0};
  o.launch.lanes = 2;
  o.launch.gpu_prefill_threshold = 0;  // GPU prefill off reaches numoe-gpu's command line
  o.launch.pass_rows = 8192;
  o.launch.merge_lanes = MergeLanes::kOff;
  o.launch.sim_expert_gbps = 0.0026;  // not exact in binary: every digit must survive the unit file
  o.launch.micro_batches = 2;
  o.launch.prefill_lane_tokens = 8192;
  o.launch.prefill_lane_piece_rows = 64;
  o.launch.gpu_port = 7000;
  o.launch.worker_base_port = 7100;
  o.launch.router_port = 9000;
  o.launch.affinity_prefix_tokens = 0;
  const Plan plan = UnevenPlan();
  auto files = RenderSystemd(plan, o);
  ASSERT_TRUE(files.ok()) << files.status();
  const gpu::GpuAppConfig g = GpuOf(Find(*files, "numoe-gpu.service")->content);
  EXPECT_EQ(g.model_dir, "/models/v4");
  EXPECT_EQ(g.backend, Backend::kCuda);
  EXPECT_EQ(g.spec, SpecChoice::kDspark);
  EXPECT_EQ(g.drafter_experts, DrafterExperts::kGpu);
  EXPECT_EQ(g.port, 7000);
  EXPECT_EQ(g.gpus, (std::vector<int>{1, 0}));
  EXPECT_EQ(g.lanes, 2);
  EXPECT_EQ(g.gpu_prefill_threshold, 0);
  EXPECT_EQ(g.pass_rows, 8192);
  EXPECT_EQ(g.merge_lanes, MergeLanes::kOff);  // --merge-lanes through the launch files
  EXPECT_GE(g.max_sequences, 300);  // admits the workers' --max-seqs
  std::vector<std::string> addrs;
  for (const WorkerPlacement& p : plan.workers) {
    SCOPED_TRACE(p.index);
    const worker::WorkerAppConfig w =
        WorkerOf(Find(*files, absl::StrCat("numoe-worker-", p.index, ".service"))->content);
    EXPECT_EQ(w.gpu_address, "127.0.0.1:7000");
    EXPECT_EQ(w.port, 7100 + p.index);
    EXPECT_EQ(w.numa_nodes, p.nodes);
    EXPECT_EQ(w.cpus, p.thread_cpus);  // --cpus pins kernel thread i to the i-th CPU
    EXPECT_EQ(w.threads, p.threads);
    EXPECT_EQ(w.spec, SpecChoice::kDspark);
    EXPECT_EQ(w.spec_depth, 3);
    EXPECT_EQ(w.max_seqs, 300);
    EXPECT_EQ(w.drafter_experts, DrafterExperts::kGpu);
    EXPECT_EQ(w.sim_expert_gbps, 0.0026);
    EXPECT_EQ(w.micro_batches, 2);
    EXPECT_EQ(w.prefill_lane_tokens, 8192);
    EXPECT_EQ(w.prefill_lane_piece_rows, 64);
    addrs.push_back(absl::StrCat(w.host, ":", w.port));
  }
  const router::RouterAppConfig r = RouterOf(Find(*files, "numoe-router.service")->content);
  EXPECT_EQ(r.router.balancer.workers, addrs);
  EXPECT_EQ(r.router.http_port, 9000);
  EXPECT_EQ(r.router.balancer.policy.prefix_tokens, 0);
}

// Every micro-batch and prefill lane is a session of its own in numoe-gpu: with --lanes left at its default,
// numoe-gpu gets a lane for each (never fewer than its default); an explicit --lanes is kept.
TEST(EmitSystemd, MicroBatchesGiveNumoeGpuALanePerSession) {
  const Plan plan = UnevenPlan();
  const int64_t workers = static_cast<int64_t>(plan.workers.size());
  for (int64_t lanes : {-1, 1}) {
    for (int64_t lane_tokens : {-1, 0, 4096}) {
      EmitOptions o;
      o.launch.model_dir = "/models/v4";
      o.launch.backend = Backend::kCuda;
      o.launch.micro_batches = 2;
      o.launch.lanes = lanes;
      o.launch.prefill_lane_tokens = lane_tokens;
      auto files = RenderSystemd(plan, o);
      ASSERT_TRUE(files.ok()) << files.status();
      const gpu::GpuAppConfig g = GpuOf(Find(*files, "numoe-gpu.service")->content);
      const bool lane = (lane_tokens < 0 ? worker::WorkerAppConfig{}.prefill_lane_tokens : lane_tokens) > 0;
      const int64_t sessions = 2 + (lane ? 1 : 0);
      EXPECT_EQ(g.lanes, lanes < 0 ? std::max<int64_t>(sessions * workers, gpu::GpuAppConfig{}.lanes) : lanes)
          << lanes << " " << lane_tokens;
    }
  }
}

TEST(EmitSystemd, NoNumaBindDropsNumactlAndBindsNothing) {
  EmitOptions o;
  o.launch.no_numa_bind = true;
  auto files = RenderSystemd(UnevenPlan(), o);
  ASSERT_TRUE(files.ok()) << files.status();
  for (const EmittedFile& f : *files) {
    EXPECT_THAT(f.content, Not(HasSubstr("numactl --"))) << f.name;
    EXPECT_THAT(f.content, Not(HasSubstr("NUMAPolicy="))) << f.name;
  }
  const worker::WorkerAppConfig w = WorkerOf(Find(*files, "numoe-worker-2.service")->content);
  EXPECT_TRUE(w.no_numa_bind);
  EXPECT_TRUE(w.numa_nodes.empty());
  EXPECT_EQ(ExecStart(Find(*files, "numoe-gpu.service")->content)[0], "/usr/local/bin/numoe-gpu");
}

TEST(EmitSystemd, SplitExecStartUndoesTheQuoting) {
  auto words = SplitExecStart("/bin/x --a \"b c\" 100%% \"q\\\"d\" $$V");
  ASSERT_TRUE(words.ok()) << words.status();
  EXPECT_EQ(*words, (std::vector<std::string>{"/bin/x", "--a", "b c", "100%", "q\"d", "$V"}));
  EXPECT_FALSE(SplitExecStart("/bin/x \"open").ok());
}

TEST(EmitKubernetes, PodPerWorkerGpuPerHostRouterService) {
  EmitOptions o;
  o.launch.model_dir = "/models/v4";
  o.k8s_hostname = "box1";
  auto files = RenderKubernetes(UnevenPlan(), o);
  ASSERT_OK(files);
  ASSERT_EQ(files->size(), 1u);
  const std::string& y = (*files)[0].content;
  EXPECT_EQ((*files)[0].name, "numoe.yaml");
  EXPECT_EQ(Count(y, "kind: Pod\n"), 4u);  // numoe-gpu + 3 workers
  EXPECT_EQ(Count(y, "kind: Deployment\n"), 1u);
  EXPECT_EQ(Count(y, "kind: Service\n"), 1u);
  EXPECT_THAT(y, HasSubstr("name: numoe-gpu\n"));
  EXPECT_THAT(y, HasSubstr("nvidia.com/gpu: 1"));
  EXPECT_THAT(y, HasSubstr("  name: numoe-worker-2\n"));
  EXPECT_THAT(y, HasSubstr("numoe.dev/numa-nodes: \"2,3\""));
  EXPECT_THAT(y, HasSubstr("        - \"/usr/bin/numactl\"\n        - \"--cpunodebind=0\"\n        - \"--membind=0\"\n"
                           "        - \"/usr/local/bin/numoe-worker\"\n        - \"--model\"\n        - \"/models/v4\"\n"));
  EXPECT_THAT(y, HasSubstr("        - \"--numa-node\"\n        - \"0\"\n"));
  EXPECT_THAT(y, HasSubstr("        - \"--threads\"\n        - \"24\"\n"));
  // The workers listen where the router's pod reaches them (the host's IP), the router where its Service does.
  EXPECT_THAT(y, HasSubstr("        - \"--host\"\n        - \"0.0.0.0\"\n"));
  EXPECT_THAT(y, HasSubstr("        - \"--interleave=2,3\"\n"));
  EXPECT_THAT(y, HasSubstr("memory: \"164G\""));  // 163.73 GB rounded up
  EXPECT_THAT(y, HasSubstr("kubernetes.io/hostname: \"box1\""));
  EXPECT_THAT(y, HasSubstr("hostIPC: true"));
  EXPECT_THAT(y, HasSubstr("\"$(HOST_IP):50061,$(HOST_IP):50062,$(HOST_IP):50063\""));
  EXPECT_THAT(y, HasSubstr("numoe-worker --help"));
}

TEST(EmitFiles, WritesRefusesToOverwriteAndForces) {
  const test::TempDir tmp("numoe-emit");
  const fs::path& dir = tmp.path();
  auto files = RenderSystemd(UnevenPlan(), EmitOptions{});
  ASSERT_OK(files);
  auto written = WriteEmittedFiles(*files, (dir / "units").string(), false);
  ASSERT_OK(written);
  ASSERT_EQ(written->size(), 6u);
  std::ifstream in(dir / "units" / "numoe-worker-1.service");
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_THAT(ss.str(), HasSubstr("--cpunodebind=1 --membind=1"));

  auto again = WriteEmittedFiles(*files, (dir / "units").string(), false);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("numoe-gpu.service exists"));
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("--force"));
  EXPECT_OK(WriteEmittedFiles(*files, (dir / "units").string(), true));
  for (const auto& entry : fs::directory_iterator(dir / "units")) {
    EXPECT_THAT(entry.path().filename().string(), Not(HasSubstr(".tmp")));
  }

  // A file where the directory should be.
  std::ofstream(dir / "file") << "x";
  EXPECT_FALSE(WriteEmittedFiles(*files, (dir / "file").string(), false).ok());
}

TEST(Emit, NothingToEmitWithoutWorkers) {
  auto plan = MakePlan(Described("small", {{128, 4, 16}}), FullSizeModel(), PlanOptions{});
  ASSERT_OK(plan);
  EXPECT_EQ(RenderSystemd(*plan, EmitOptions{}).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(RenderKubernetes(*plan, EmitOptions{}).status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace numoe::deploy
