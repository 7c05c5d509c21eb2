// One definition of each daemon's command line: a config with every field away from its default goes
// config -> argv (XArgv) -> parse with the daemon's own flags (AddXFlags) -> the same config, and the argv
// names every flag the daemon registers (so a new field without a flag, or a flag the writer drops, fails
// here). Enumerated flags share one message.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "common/args.h"
#include "gpu_service/gpu_flags.h"
#include "router/router_flags.h"
#include "worker/service/worker_flags.h"

namespace numoe {
namespace {

using ::testing::HasSubstr;

Status ParseWords(ArgParser& p, std::vector<std::string> words) {
  std::vector<char*> argv = {const_cast<char*>("daemon")};
  for (auto& w : words) argv.push_back(w.data());
  return p.Parse(static_cast<int>(argv.size()), argv.data());
}

// The flag names in an argv ("--name" words).
std::set<std::string> FlagsIn(const std::vector<std::string>& argv) {
  std::set<std::string> out;
  for (const std::string& w : argv) {
    if (w.rfind("--", 0) == 0) out.insert(w.substr(2));
  }
  return out;
}

// Parses `argv` with AddFlags onto a default Config; expects `want` back and every registered flag used.
template <typename Config, typename AddFlags>
void ExpectRoundTrip(const Config& want, const std::vector<std::string>& argv, AddFlags add_flags) {
  Config got;
  ArgParser p("daemon", "");
  add_flags(p, &got);
  ASSERT_TRUE(ParseWords(p, argv).ok()) << ParseWords(p, argv);
  EXPECT_TRUE(got == want);
  const std::set<std::string> used = FlagsIn(argv);
  for (const std::string& name : p.names()) EXPECT_TRUE(used.count(name)) << "--" << name << " not written";
}

TEST(WorkerFlags, RoundTripsEveryField) {
  worker::WorkerAppConfig c;
  c.model_dir = "/models/my model";
  c.gpu_address = "10.0.0.2:6000";
  c.host = "0.0.0.0";
  c.port = 7001;
  c.numa_nodes = {2, 3};
  c.no_numa_bind = true;
  c.threads = 12;
  c.cpus = {4, 5, 6};
  c.max_seqs = 33;
  c.max_step_tokens = 1024;
  c.prefill_chunk = 0;
  c.max_queue = 7;
  c.default_max_tokens = 99;
  c.worker_id = "w-7";
  c.gpu_wait_ms = 5;
  c.experts = worker::ExpertsImpl::kReference;
  c.spec = SpecChoice::kNgram;
  c.spec_depth = 3;
  c.spec_adaptive = true;
  c.drafter_experts = DrafterExperts::kGpu;
  c.sim_expert_gbps = 0.0026;  // not exact in binary: the writer must keep every digit
  c.micro_batches = worker::WorkerAppConfig{}.micro_batches == 1 ? 2 : 1;
  c.prefill_lane_tokens = worker::WorkerAppConfig{}.prefill_lane_tokens == 0 ? 4096 : 0;
  c.prefill_lane_piece_rows = worker::WorkerAppConfig{}.prefill_lane_piece_rows + 7;
  ExpectRoundTrip(c, worker::WorkerArgv(c), worker::AddWorkerFlags);
}

TEST(WorkerFlags, SimExpertGbpsMustBeAPositiveFiniteRate) {
  for (const char* bad : {"0", "-1", "nan", "inf", "1e6", "fast"}) {
    worker::WorkerAppConfig c;
    ArgParser p("numoe-worker", "");
    worker::AddWorkerFlags(p, &c);
    const Status st = ParseWords(p, {"--model", "m", "--sim-expert-gbps", bad});
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--sim-expert-gbps")) << bad;
    EXPECT_EQ(c.sim_expert_gbps, 0) << bad;
  }
  worker::WorkerAppConfig c;
  ArgParser p("numoe-worker", "");
  worker::AddWorkerFlags(p, &c);
  ASSERT_TRUE(ParseWords(p, {"--model", "m", "--sim-expert-gbps", "100"}).ok());
  EXPECT_EQ(c.sim_expert_gbps, 100);
  EXPECT_THAT(p.Help(), HasSubstr("--sim-expert-gbps G"));
  // Off by default, and then not written.
  EXPECT_TRUE(worker::WorkerArgv(worker::WorkerAppConfig{}).empty());
}

TEST(WorkerFlags, PrefillLaneTokensAreNonNegative) {
  for (const char* bad : {"-1", "many"}) {
    worker::WorkerAppConfig c;
    ArgParser p("numoe-worker", "");
    worker::AddWorkerFlags(p, &c);
    const Status st = ParseWords(p, {"--model", "m", "--prefill-lane-tokens", bad});
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--prefill-lane-tokens")) << bad;
  }
  worker::WorkerAppConfig c;
  ArgParser p("numoe-worker", "");
  worker::AddWorkerFlags(p, &c);
  ASSERT_TRUE(ParseWords(p, {"--model", "m", "--prefill-lane-tokens", "0", "--prefill-lane-piece-rows", "64"}).ok());
  EXPECT_EQ(c.prefill_lane_tokens, 0);
  EXPECT_EQ(c.prefill_lane_piece_rows, 64);
  EXPECT_THAT(p.Help(), HasSubstr("--prefill-lane-tokens N"));
}

TEST(WorkerFlags, MicroBatchesAreOneOrTwo) {
  for (const char* bad : {"0", "3", "-1", "two"}) {
    worker::WorkerAppConfig c;
    ArgParser p("numoe-worker", "");
    worker::AddWorkerFlags(p, &c);
    const Status st = ParseWords(p, {"--model", "m", "--micro-batches", bad});
    EXPECT_FALSE(st.ok()) << bad;
    EXPECT_THAT(std::string(st.message()), HasSubstr("--micro-batches")) << bad;
  }
  worker::WorkerAppConfig c;
  ArgParser p("numoe-worker", "");
  worker::AddWorkerFlags(p, &c);
  ASSERT_TRUE(ParseWords(p, {"--model", "m", "--micro-batches", "2"}).ok());
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_THAT(p.Help(), HasSubstr("--micro-batches N"));
}

TEST(WorkerFlags, WritesOnlyWhatDiffersFromTheDefaults) {
  worker::WorkerAppConfig c;
  c.model_dir = "/m";
  c.port = 50062;
  EXPECT_EQ(worker::WorkerArgv(c), (std::vector<std::string>{"--model", "/m", "--port", "50062"}));
  EXPECT_TRUE(worker::WorkerArgv(worker::WorkerAppConfig{}).empty());
}

TEST(GpuFlags, RoundTripsEveryField) {
  gpu::GpuAppConfig c;
  c.model_dir = "/models/v4";
  c.backend = Backend::kCuda;
  c.host = "0.0.0.0";
  c.port = 6000;
  c.heartbeat_ms = 250;
  c.lease_ms = 4000;
  c.max_workers = 3;
  c.spin_us = 0;
  c.max_sequences = 512;
  c.threads = 8;
  c.cuda_device = 1;
  c.tp = 2;
  c.gpus = {3, 1};
  c.lanes = 2;
  c.drafter_experts = DrafterExperts::kGpu;
  c.spec = SpecChoice::kDspark;
  c.no_prefix_cache = true;
  c.prefix_cache_gb = 1.5;
  c.prefix_cache_host_gb = 0.25;
  c.prefix_checkpoint_tokens = 512;
  c.gpu_prefill_threshold = 1536;
  c.pass_rows = 8192;
  c.merge_lanes = MergeLanes::kOn;
  ExpectRoundTrip(c, gpu::GpuArgv(c), gpu::AddGpuFlags);
}

TEST(RouterFlags, RoundTripsEveryField) {
  router::RouterAppConfig c;
  router::RouterConfig& r = c.router;
  r.model_dir = "/models/v4";
  r.balancer.workers = {"127.0.0.1:50061", "10.0.0.3:50062"};
  r.host = "0.0.0.0";
  r.http_port = 9000;
  r.grpc_port = -1;
  r.served_model_name = "v4";
  r.max_model_len = 4096;
  r.frontend.default_max_tokens = 17;
  r.balancer.max_queue = 9;
  r.balancer.max_in_flight_per_worker = 5;
  r.balancer.queue_timeout_s = 0.125;
  r.balancer.request_timeout_s = 30.5;
  r.balancer.health_interval_s = 0.3;  // not exact in binary: the writer must keep every digit
  r.balancer.health_timeout_s = 1.7;
  r.balancer.policy.prefix_tokens = 0;
  r.api_key = "secret";
  r.api_key_file = "/etc/numoe/keys";
  r.tls_cert = "/etc/numoe/cert.pem";
  r.tls_key = "/etc/numoe/key.pem";
  r.max_body_bytes = 1 << 20;
  r.max_header_bytes = 16 << 10;
  r.max_connections = 77;
  r.frontend.max_prompt_tokens = 3000;
  r.receive_timeout_s = 7.5;
  r.idle_timeout_s = 0.3;
  r.http_threads = 4;
  c.drain_timeout_s = 2.5;
  c.ready_file = "/run/numoe/router.ready";
  ExpectRoundTrip(c, router::RouterArgv(c), router::AddRouterFlags);
}

TEST(RouterFlags, ABadWorkerListNamesTheEntry) {
  router::RouterAppConfig c;
  ArgParser p("numoe-router", "");
  router::AddRouterFlags(p, &c);
  const Status st = ParseWords(p, {"--model", "/m", "--workers", "127.0.0.1:1,nohost"});
  EXPECT_THAT(std::string(st.message()), HasSubstr("--workers: 'nohost' is not host:port"));
}

TEST(EnumFlags, OneMessageForEveryEnum) {
  worker::WorkerAppConfig w;
  ArgParser pw("numoe-worker", "");
  worker::AddWorkerFlags(pw, &w);
  EXPECT_EQ(ParseWords(pw, {"--model", "m", "--spec", "eagle"}).message(),
            "--spec must be auto, none, dspark, mtp or ngram (got 'eagle')");
  EXPECT_EQ(ParseWords(pw, {"--model", "m", "--drafter-experts", "cpu"}).message(),
            "--drafter-experts must be worker or gpu (got 'cpu')");
  EXPECT_EQ(ParseWords(pw, {"--model", "m", "--experts", "auto"}).message(),
            "--experts must be kernels or reference (got 'auto')");
  gpu::GpuAppConfig g;
  ArgParser pg("numoe-gpu", "");
  gpu::AddGpuFlags(pg, &g);
  EXPECT_EQ(ParseWords(pg, {"--model", "m", "--backend", "rocm"}).message(),
            "--backend must be auto, cpu or cuda (got 'rocm')");
  EXPECT_THAT(pg.Help(), HasSubstr("--backend auto|cpu|cuda"));
  EXPECT_THAT(pg.Help(), HasSubstr("(default: cpu)"));
}

// --tp and --gpus settle the same way wherever numoe-gpu's config is made (numoe-gpu, serve, plan).
TEST(GpuFlags, GpusSetTheTensorParallelDegreeAndAreChecked) {
  auto resolve = [](gpu::GpuAppConfig c, int devices) -> StatusOr<gpu::GpuAppConfig> {
    RETURN_IF_ERROR(gpu::ResolveGpus(&c, devices));
    return c;
  };
  gpu::GpuAppConfig c{.backend = Backend::kCuda};
  c.gpus = {2, 0};
  auto r = resolve(c, 4);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tp, 2);
  EXPECT_EQ(r->gpus, (std::vector<int>{2, 0}));
  EXPECT_TRUE(resolve(c, -1).ok());  // device count unknown (plan for another machine)
  EXPECT_EQ(resolve(c, 2).status().message(), "--gpus: GPU 2 requested but this machine has 2 CUDA device(s)");
  c.tp = 3;
  EXPECT_EQ(resolve(c, 4).status().message(),
            "--tp 3 disagrees with --gpus, which lists 2 GPU(s): give one of them");
  c.tp = 1;
  c.gpus = {1, 1};
  EXPECT_EQ(resolve(c, 4).status().message(), "--gpus lists GPU 1 twice");
  c.gpus = {};
  c.tp = 2;
  EXPECT_TRUE(resolve(c, 2).ok());
  EXPECT_EQ(resolve(c, 1).status().message(),
            "--tp 2 from --cuda-device 0 needs GPUs 0..1 but this machine has 1 CUDA device(s)");
  c.backend = Backend::kCpu;
  EXPECT_THAT(std::string(resolve(c, -1).status().message()), HasSubstr("the backend is cpu"));
  c.tp = 1;
  EXPECT_TRUE(resolve(c, 0).ok());  // the CPU backend's default config
}

}  // namespace
}  // namespace numoe
