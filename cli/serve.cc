// numoe serve: the whole system on one machine as child processes — numoe-gpu, N numoe-workers (one per
// NUMA node by default, as deploy's planner places them) and numoe-router — on loopback ports. The
// children's command lines come from the launch plan `numoe plan --emit` renders too (deploy/launch.h);
// deploy/supervisor.h starts, restarts and stops them.
//
//   start numoe-gpu            wait for its READY (NUMOE_NOTIFY_FD pipe)
//   start the workers          wait for every READY
//   start numoe-router         wait for its --ready-file
//   print one ready line on stdout (the only stdout output; children's stdout goes to stderr)
//   supervise: a child that exits is restarted with exponential backoff (1 s doubling to 30 s, reset after
//   a minute of uptime), logged; numoe-gpu restarting makes the workers exit and restart too
//   SIGINT/SIGTERM: SIGTERM to every child, SIGKILL after --stop-timeout, then exit
//
// --backend auto (the default): cuda when a CUDA device is present, else cpu; the ready line says which.
// Speculative decoding: --spec / --spec-depth / --spec-adaptive go to numoe-gpu (which drafter to load)
// and to every worker (which drafter the engine uses). Combinations that cannot run (a drafter the
// checkpoint lacks, MTP on the CUDA backend) are refused here, before anything is loaded
// (model/spec_policy.h).
// Any --max-seqs x --spec-depth x --max-step-tokens runs: the engine shares the step budget between
// decode tokens, drafts and prompt chunks.
//
// No orphans: children are in serve's process group and have PR_SET_PDEATHSIG(SIGTERM), so even a
// SIGKILLed serve takes them down. A child that fails before it was ever ready (bad model, port in use)
// stops serve with its exit status: restarting a misconfiguration forever would hide it.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_join.h"
#include "backends/cuda/cuda_model.h"
#include "cli/commands.h"
#include "common/args.h"
#include "common/choices.h"
#include "common/free_port.h"
#include "common/log.h"
#include "common/status.h"
#include "common/topology.h"
#include "deploy/launch.h"
#include "deploy/model_memory.h"
#include "deploy/placement.h"
#include "deploy/planner.h"
#include "deploy/supervisor.h"
#include "gpu_service/gpu_flags.h"
#include "router/router_flags.h"
#include "worker/service/worker_flags.h"

namespace numoe::cli {
namespace {

struct ServeConfig {
  deploy::LaunchOptions launch;  // the flags serve shares with `numoe plan` (deploy/launch.h)
  std::string model_dir;
  int64_t workers = 0;  // 0 = the planner's choice
  bool no_router = false;
  int64_t gpu_port = 0;  // numoe-gpu's gRPC port (0 = a free one)
  deploy::SupervisorOptions supervisor;
};

std::string BinDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

// Where the workers go: the planner's placement (one per node that holds a copy), or `count` workers
// placed by the same rule (deploy/placement.h) without the memory check.
StatusOr<std::vector<WorkerPlacement>> PlaceWorkers(const ServeConfig& c) {
  const int threads = static_cast<int>(c.launch.threads_per_worker);
  if (c.workers == 0) {
    ASSIGN_OR_RETURN(deploy::ModelMemory mem, deploy::LoadModelMemory(c.model_dir));
    auto plan = deploy::PlanForThisMachine(
        mem, deploy::PlanOptions{.drafter_experts = c.launch.drafter_experts, .threads_per_worker = threads});
    if (!plan.ok()) {
      return Status(plan.status().code(), absl::StrCat(plan.status().message(),
                                                       "\n(pass --workers N to start workers anyway)"));
    }
    return plan->workers;
  }
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  return deploy::PlaceWorkers(topology, {.workers = static_cast<int>(c.workers), .threads_per_worker = threads});
}

// The children of `plan`, registered with `sup` in start order: numoe-gpu, the workers, the router.
struct Children {
  deploy::Child* gpu = nullptr;
  std::vector<deploy::Child*> workers;
  deploy::Child* router = nullptr;  // nullptr with --no-router
};

Children AddChildren(const deploy::LaunchPlan& plan, bool with_router, deploy::Supervisor* sup) {
  const std::string bin = BinDir();
  Children ch;
  ch.gpu = sup->Add(deploy::Child{.name = "numoe-gpu", .binary = bin + "/numoe-gpu", .args = gpu::GpuArgv(plan.gpu)});
  for (size_t i = 0; i < plan.workers.size(); ++i) {
    ch.workers.push_back(sup->Add(deploy::Child{.name = absl::StrCat("numoe-worker-", i),
                                                .tier = 1,
                                                .binary = bin + "/numoe-worker",
                                                .args = worker::WorkerArgv(plan.workers[i])}));
  }
  if (with_router) {
    ch.router = sup->Add(deploy::Child{.name = "numoe-router",
                                       .tier = 2,
                                       .binary = bin + "/numoe-router",
                                       .args = router::RouterArgv(plan.router),
                                       .ready_file = plan.router.ready_file});
  }
  return ch;
}

int Serve(ServeConfig c) {
  // Signals are taken synchronously by the supervision loop (children reset their mask before exec).
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGCHLD);
  sigprocmask(SIG_BLOCK, &set, nullptr);

  auto fail = [](const Status& st) {
    NLOG(ERROR) << "numoe serve: " << st;
    return 1;
  };
  if (!std::filesystem::exists(std::filesystem::path(c.model_dir) / "config.json")) {
    return fail(absl::NotFoundError(absl::StrCat("--model: ", c.model_dir, "/config.json does not exist")));
  }
  const int cuda_devices = CudaDeviceCount();
  deploy::LaunchOptions& o = c.launch;
  const bool auto_backend = o.backend == Backend::kAuto;
  o.backend = ResolveBackend(o.backend, cuda_devices);
  const std::string backend =
      auto_backend ? absl::StrCat(ChoiceName(o.backend), " backend (auto: ", cuda_devices, " CUDA device",
                                  cuda_devices == 1 ? "" : "s", ")")
                   : absl::StrCat(ChoiceName(o.backend), " backend");
  o.model_dir = std::filesystem::absolute(c.model_dir).string();
  if (Status st = deploy::CheckLaunchOptions(o, cuda_devices); !st.ok()) return fail(st);
  if (!c.supervisor.log_dir.empty()) std::filesystem::create_directories(c.supervisor.log_dir);
  auto slots = PlaceWorkers(c);
  if (!slots.ok()) return fail(slots.status());
  if (slots->empty()) return fail(absl::ResourceExhaustedError("the plan has no workers"));

  // Ports are chosen once, so a restarted child comes back where the others expect it.
  auto gpu_port = c.gpu_port > 0 ? StatusOr<int>(static_cast<int>(c.gpu_port)) : ReserveLocalPort();
  if (!gpu_port.ok()) return fail(gpu_port.status());
  o.gpu_port = *gpu_port;
  for (size_t i = 0; i < slots->size(); ++i) {
    auto port = ReserveLocalPort();
    if (!port.ok()) return fail(port.status());
    o.worker_ports.push_back(*port);
  }
  auto plan = deploy::MakeLaunchPlan(o, *slots);
  if (!plan.ok()) return fail(plan.status());
  if (!c.no_router) {
    plan->router.ready_file = std::filesystem::temp_directory_path() /
                              absl::StrCat("numoe-serve-", getpid(), "-router.ready");
    plan->router.drain_timeout_s = std::max(c.supervisor.stop_timeout_s - 2.0, 0.1);
  }

  deploy::Supervisor sup(c.supervisor);
  const Children ch = AddChildren(*plan, !c.no_router, &sup);
  Status failure;
  auto stop = [&](int sig) {
    NLOG(INFO) << "numoe serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping every process";
    sup.StopAll();
    return 0;
  };
  // numoe-gpu first: workers register with it.
  if (Status st = sup.Start(ch.gpu); !st.ok()) return fail(st);
  if (int r = sup.WaitReady({ch.gpu}, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));
  for (deploy::Child* w : ch.workers) {
    if (Status st = sup.Start(w); !st.ok()) return (sup.StopAll(), fail(st));
  }
  if (int r = sup.WaitReady(ch.workers, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));

  const std::string workers = absl::StrJoin(plan->router.router.balancer.workers, ",");
  const std::string gpu_addr = absl::StrCat(plan->gpu.host, ":", plan->gpu.port);
  std::string ready_line;
  if (ch.router == nullptr) {
    ready_line = absl::StrCat("numoe serve ready: workers (gRPC numoe.v1.Worker) ", workers, ", numoe-gpu ", gpu_addr,
                              " (--no-router, ", backend, ")");
  } else {
    if (Status st = sup.Start(ch.router); !st.ok()) return (sup.StopAll(), fail(st));
    if (int r = sup.WaitReady({ch.router}, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));
    const router::RouterConfig& rc = plan->router.router;
    ready_line = absl::StrCat("numoe serve ready: REST ", rc.tls_cert.empty() ? "http" : "https", "://", rc.host, ":", rc.http_port, "/v1  gRPC ", rc.host, ":",
                              rc.grpc_port, "  (", ch.workers.size(), " worker(s), ", backend, ")");
  }
  std::printf("%s\n", ready_line.c_str());
  std::fflush(stdout);

  for (;;) {
    Status ignored;
    const int sig = sup.Tick(200, /*restart=*/true, &ignored);
    if (sig != 0) return stop(sig);
  }
}

}  // namespace

int RunServe(int argc, char** argv) {
  ServeConfig c;
  ArgParser p(argv[0],
              "Start numoe-gpu, the workers (one per NUMA node by default) and numoe-router as child processes,\n"
              "wait until all are ready, print one ready line, restart crashed children, stop all on Ctrl-C.");
  p.AddString("model", "DIR", "checkpoint directory", &c.model_dir, true);
  p.AddInt("workers", "N", "numoe-workers to start (0 = the planner's: one per NUMA node that holds a copy)",
           &c.workers, 0, 1024);
  deploy::AddLaunchFlags(p, &c.launch);
  p.AddInt("gpu-port", "N", "numoe-gpu's gRPC port on 127.0.0.1 (GpuService Stats; 0 = a free port)", &c.gpu_port, 0,
           65535);
  p.AddFlag("no-router", "start numoe-gpu and the workers only (the ready line lists the workers)", &c.no_router);
  p.AddString("log-dir", "DIR", "write each child's log to DIR/<name>.log (default: this terminal's stderr)",
              &c.supervisor.log_dir);
  p.AddDouble("stop-timeout", "S", "on shutdown, SIGKILL children still running after this long",
              &c.supervisor.stop_timeout_s, 0.1, 3600);
  p.AddDouble("startup-timeout", "S", "give up when not everything is ready after this long",
              &c.supervisor.startup_timeout_s, 1, 86400);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  return Serve(std::move(c));
}

}  // namespace numoe::cli
