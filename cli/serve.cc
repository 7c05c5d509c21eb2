// numoe serve: the whole system on one machine as child processes — numoe-gpu, N numoe-workers (one per
// NUMA node by default, as deploy's planner places them) and numoe-router — on loopback ports.
//
//   start numoe-gpu            wait for its READY (NUMOE_NOTIFY_FD pipe)
//   start the workers          wait for every READY
//   start numoe-router         wait for its --ready-file
//   print one ready line on stdout (the only stdout output; children's stdout goes to stderr)
//   supervise: a child that exits is restarted with exponential backoff (1 s doubling to 30 s, reset after
//   a minute of uptime), logged; numoe-gpu restarting makes the workers exit and restart too
//   SIGINT/SIGTERM: SIGTERM to every child, SIGKILL after --stop-timeout, then exit
//
// Speculative decoding: --spec / --spec-depth / --spec-adaptive go to numoe-gpu (which drafter to load)
// and to every worker (which drafter the engine uses). Combinations that cannot run (a drafter the
// checkpoint lacks, MTP on the CUDA backend) are refused here, before anything is loaded.
// Any --max-seqs x --spec-depth x --max-step-tokens runs: the engine shares the step budget between
// decode tokens, drafts and prompt chunks.
//
// No orphans: children are in serve's process group and have PR_SET_PDEATHSIG(SIGTERM), so even a
// SIGKILLed serve takes them down. A child that fails before it was ever ready (bad model, port in use)
// stops serve with its exit status: restarting a misconfiguration forever would hide it.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "common/args.h"
#include "common/checkpoint.h"
#include "common/log.h"
#include "common/status.h"
#include "common/topology.h"
#include "deploy/model_memory.h"
#include "deploy/placement.h"
#include "deploy/planner.h"
#include "model/spec.h"

namespace numoe::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct ServeConfig {
  std::string model_dir;
  int64_t workers = 0;  // 0 = the planner's choice
  std::string backend = "cpu";
  std::string host = "127.0.0.1";
  int64_t port = 8000;
  int64_t grpc_port = 8001;
  int64_t threads_per_worker = 0;
  int64_t max_seqs = 0, max_step_tokens = 0, prefill_chunk = -1;
  bool no_numa_bind = false;
  bool no_router = false;
  std::string log_dir;
  double stop_timeout_s = 15;
  double startup_timeout_s = 900;
  std::string spec = "auto";  // auto | none | dspark | mtp | ngram
  int64_t spec_depth = 0;     // 0 = the checkpoint's dspark_block_size, else 5
  bool spec_adaptive = false;
  std::string drafter_experts = "worker";  // worker | gpu (--backend cuda)
};

// The checks numoe-gpu and the workers would fail on, made before any child starts (and before any
// weight is loaded), with what to change.
Status CheckSpecFlags(const ServeConfig& c) {
  if (c.drafter_experts != "worker" && c.drafter_experts != "gpu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--drafter-experts must be worker or gpu (got '", c.drafter_experts, "')"));
  }
  if (c.drafter_experts == "gpu" && c.backend != "cuda") {
    return absl::InvalidArgumentError(
        "--drafter-experts gpu needs --backend cuda (the CPU backend's drafter experts run on the workers)");
  }
  if (c.spec == "auto") return absl::OkStatus();
  auto m = ParseSpecMethod(c.spec);
  if (!m.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec must be auto, none, dspark, mtp or ngram (got '", c.spec, "')"));
  }
  if (*m != SpecMethod::kDspark && *m != SpecMethod::kMtp) return absl::OkStatus();
  if (c.backend == "cuda" && *m == SpecMethod::kMtp) {
    return absl::FailedPreconditionError(
        "--spec mtp: the CUDA backend has no MTP drafter; use --spec ngram or none, or --backend cpu");
  }
  ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(c.model_dir));
  const char* own = SpecMethodName(ckpt->drafter());
  if (c.spec != own) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--spec ", c.spec, ": ", c.model_dir, " has ", std::string(own) == "none" ? "no drafter stages" : absl::StrCat("a ", own, " drafter"),
        " (", ckpt->mtp_stages(), " mtp.* stages, dspark_block_size ", ckpt->config().dspark_block_size, "); use --spec ",
        std::string(own) == "none" ? "ngram or none" : absl::StrCat(own, ", ngram or none")));
  }
  return absl::OkStatus();
}

// A free TCP port on 127.0.0.1 (bound, read, released). Ports are chosen once, so a restarted worker
// comes back where the router expects it.
StatusOr<int> FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError("socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return absl::InternalError("cannot find a free loopback port");
  }
  close(fd);
  return static_cast<int>(ntohs(a.sin_port));
}

std::string BinDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string(".") : exe.parent_path().string();
}

std::string Join(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ",") + std::to_string(x);
  return s;
}

// Where the workers go: the planner's placement (one per node that holds a copy), or `count` workers
// placed by the same rule (deploy/placement.h) without the memory check.
StatusOr<std::vector<WorkerPlacement>> PlaceWorkers(const ServeConfig& c) {
  const int threads = static_cast<int>(c.threads_per_worker);
  if (c.workers == 0) {
    ASSIGN_OR_RETURN(deploy::ModelMemory mem, deploy::LoadModelMemory(c.model_dir));
    auto plan = deploy::PlanForThisMachine(mem, deploy::PlanOptions{.threads_per_worker = threads});
    if (!plan.ok()) {
      return Status(plan.status().code(), absl::StrCat(plan.status().message(),
                                                       "\n(pass --workers N to start workers anyway)"));
    }
    return plan->workers;
  }
  ASSIGN_OR_RETURN(Topology topology, ProbeTopology());
  return deploy::PlaceWorkers(topology, {.workers = static_cast<int>(c.workers), .threads_per_worker = threads});
}

// One supervised child process.
struct Child {
  std::string name;  // "numoe-gpu", "numoe-worker-0", "numoe-router"
  int tier = 0;      // stop order: higher tiers first (router 2, workers 1, numoe-gpu 0)
  std::string binary;
  std::vector<std::string> args;
  std::string ready_file;  // router: readiness = this file exists; others: NUMOE_NOTIFY_FD
  pid_t pid = -1;
  int notify_fd = -1;
  std::string notify_buf;
  bool ready = false;
  bool ever_ready = false;
  Clock::time_point started, restart_at;
  double backoff_s = 1.0;
  int restarts = 0;
};

class Supervisor {
 public:
  explicit Supervisor(const ServeConfig& c) : c_(c) {}
  ~Supervisor() { StopAll(); }

  Child* Add(Child child) {
    children_.push_back(std::make_unique<Child>(std::move(child)));
    return children_.back().get();
  }

  Status Start(Child* ch) {
    int fds[2] = {-1, -1};
    const bool notify = ch->ready_file.empty();
    if (notify && pipe2(fds, O_CLOEXEC) != 0) return absl::InternalError("pipe2 failed");
    if (!ch->ready_file.empty()) std::filesystem::remove(ch->ready_file);
    std::string log_path;
    if (!c_.log_dir.empty()) log_path = c_.log_dir + "/" + ch->name + ".log";
    std::vector<std::string> argv_s = {ch->binary};
    argv_s.insert(argv_s.end(), ch->args.begin(), ch->args.end());
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) return absl::InternalError(absl::StrCat("fork for ", ch->name, " failed"));
    if (pid == 0) {
      // Child: die with serve, keep stdout clean for serve's ready line, unblock the signals serve blocks.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(127);
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      if (!log_path.empty()) {
        int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
          dup2(fd, 2);
          close(fd);
        }
      }
      dup2(2, 1);
      if (notify) {
        const int w = dup(fds[1]);  // not close-on-exec
        setenv("NUMOE_NOTIFY_FD", std::to_string(w).c_str(), 1);
      } else {
        unsetenv("NUMOE_NOTIFY_FD");
      }
      std::vector<char*> argv;
      for (auto& a : argv_s) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv_s[0].c_str(), argv.data());
      std::fprintf(stderr, "numoe serve: cannot run %s: %s\n", argv_s[0].c_str(), std::strerror(errno));
      _exit(127);
    }
    if (notify) {
      close(fds[1]);
      ch->notify_fd = fds[0];
    }
    ch->notify_buf.clear();
    ch->pid = pid;
    ch->ready = false;
    ch->started = Clock::now();
    NLOG(INFO) << "numoe serve: started " << ch->name << " (pid " << pid << ")";
    return absl::OkStatus();
  }

  // Runs one supervision tick (up to `wait_ms`): signals, readiness, exits and due restarts.
  // Returns the shutdown signal when one arrived, else 0. `restart` false: an exit is reported, not
  // restarted (startup phase).
  int Tick(int wait_ms, bool restart, Status* failure) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGCHLD);
    // Wait on the notify pipes and, between polls, on signals.
    std::vector<pollfd> fds;
    std::vector<Child*> owners;
    for (auto& ch : children_) {
      if (ch->notify_fd >= 0) {
        fds.push_back(pollfd{ch->notify_fd, POLLIN, 0});
        owners.push_back(ch.get());
      }
    }
    if (!fds.empty()) {
      poll(fds.data(), fds.size(), std::min(wait_ms, 50));
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents != 0) ReadNotify(owners[i]);
      }
    }
    const timespec ts{0, fds.empty() ? std::min(wait_ms, 50) * 1000000L : 0L};
    int sig = sigtimedwait(&set, nullptr, &ts);
    while (sig == SIGCHLD) sig = sigtimedwait(&set, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) return sig;

    for (auto& ch : children_) {
      if (!ch->ready_file.empty() && ch->pid > 0 && !ch->ready && std::filesystem::exists(ch->ready_file)) {
        MarkReady(ch.get(), "");
      }
    }
    // Reap exits.
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (auto& ch : children_) {
        if (ch->pid != pid) continue;
        ch->pid = -1;
        if (ch->notify_fd >= 0) close(ch->notify_fd);
        ch->notify_fd = -1;
        ch->ready = false;
        const std::string how = WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                                  : absl::StrCat("was killed by signal ", WTERMSIG(status));
        if (!restart || !ch->ever_ready) {
          *failure = absl::UnavailableError(absl::StrCat(ch->name, " ", how, " before it was ready",
                                                         c_.log_dir.empty() ? " (see its messages above)"
                                                                            : " (see " + c_.log_dir + "/" + ch->name + ".log)"));
          return 0;
        }
        const double up = std::chrono::duration<double>(Clock::now() - ch->started).count();
        if (up > 60) ch->backoff_s = 1.0;
        ch->restart_at = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(ch->backoff_s * 1000));
        NLOG(WARNING) << "numoe serve: " << ch->name << " (pid " << pid << ") " << how << " after " << up
                      << " s; restarting in " << ch->backoff_s << " s (restart #" << ch->restarts + 1 << ")";
        ch->backoff_s = std::min(ch->backoff_s * 2, 30.0);
        ++ch->restarts;
      }
    }
    // Due restarts.
    if (restart) {
      for (auto& ch : children_) {
        if (ch->pid < 0 && ch->ever_ready && Clock::now() >= ch->restart_at) {
          if (Status st = Start(ch.get()); !st.ok()) NLOG(ERROR) << "numoe serve: " << st;
        }
      }
    }
    return 0;
  }

  // Waits until every child in `group` is ready. Returns the shutdown signal (>0), 0 when ready, or -1
  // with `failure` set.
  int WaitReady(const std::vector<Child*>& group, Status* failure) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(c_.startup_timeout_s * 1000));
    for (;;) {
      bool all = true;
      for (Child* ch : group) all = all && ch->ready;
      if (all) return 0;
      if (Clock::now() > deadline) {
        *failure = absl::DeadlineExceededError(
            absl::StrCat("not every process was ready within --startup-timeout ", c_.startup_timeout_s, " s"));
        return -1;
      }
      const int sig = Tick(100, /*restart=*/false, failure);
      if (sig != 0) return sig;
      if (!failure->ok()) return -1;
    }
  }

  // SIGTERM tier by tier (router, then workers, then numoe-gpu), so nothing in flight loses its
  // downstream first; SIGKILL what is left at the deadline.
  void StopAll() {
    const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(c_.stop_timeout_s * 1000));
    for (int tier = 2; tier >= 0; --tier) {
      for (auto& ch : children_) {
        if (ch->tier == tier && ch->pid > 0) kill(ch->pid, SIGTERM);
      }
      for (;;) {
        bool left = false;
        for (auto& ch : children_) {
          if (ch->tier != tier || ch->pid <= 0) continue;
          if (waitpid(ch->pid, nullptr, WNOHANG) == ch->pid) {
            ch->pid = -1;
          } else {
            left = true;
          }
        }
        if (!left) break;
        if (Clock::now() > deadline) {
          for (auto& ch : children_) {
            if (ch->tier != tier || ch->pid <= 0) continue;
            NLOG(WARNING) << "numoe serve: " << ch->name << " did not stop within " << c_.stop_timeout_s
                          << " s; SIGKILL";
            kill(ch->pid, SIGKILL);
            waitpid(ch->pid, nullptr, 0);
            ch->pid = -1;
          }
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    for (auto& ch : children_) {
      if (ch->notify_fd >= 0) close(ch->notify_fd);
      ch->notify_fd = -1;
      std::error_code ec;  // the router's readiness file would otherwise stay in the temp directory
      if (!ch->ready_file.empty()) std::filesystem::remove(ch->ready_file, ec);
    }
  }

 private:
  void ReadNotify(Child* ch) {
    char buf[512];
    const ssize_t n = read(ch->notify_fd, buf, sizeof(buf));
    if (n <= 0) {  // closed: either after READY (normal) or by an exiting child (reaped elsewhere)
      close(ch->notify_fd);
      ch->notify_fd = -1;
      return;
    }
    ch->notify_buf.append(buf, static_cast<size_t>(n));
    const size_t nl = ch->notify_buf.find('\n');
    if (nl != std::string::npos && ch->notify_buf.rfind("READY ", 0) == 0) {
      MarkReady(ch, ch->notify_buf.substr(6, nl - 6));
    }
  }
  void MarkReady(Child* ch, const std::string& what) {
    ch->ready = true;
    const bool again = ch->ever_ready;
    ch->ever_ready = true;
    NLOG(INFO) << "numoe serve: " << ch->name << (again ? " is back" : " is ready")
               << (what.empty() ? "" : " on " + what);
  }

  const ServeConfig& c_;
  std::vector<std::unique_ptr<Child>> children_;
};

int Serve(const ServeConfig& c) {
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
  if (c.backend != "cpu" && c.backend != "cuda") {
    return fail(absl::InvalidArgumentError(absl::StrCat("--backend must be cpu or cuda (got '", c.backend, "')")));
  }
  if (Status st = CheckSpecFlags(c); !st.ok()) return fail(st);
  if (!c.log_dir.empty()) std::filesystem::create_directories(c.log_dir);
  auto slots = PlaceWorkers(c);
  if (!slots.ok()) return fail(slots.status());
  if (slots->empty()) return fail(absl::ResourceExhaustedError("the plan has no workers"));
  const std::string bin = BinDir();
  const std::string model = std::filesystem::absolute(c.model_dir).string();

  Supervisor sup(c);
  auto gpu_port = FreePort();
  if (!gpu_port.ok()) return fail(gpu_port.status());
  const std::string gpu_addr = absl::StrCat("127.0.0.1:", *gpu_port);
  Child* gpu = sup.Add(Child{.name = "numoe-gpu",
                             .binary = bin + "/numoe-gpu",
                             .args = {"--model", model, "--backend", c.backend, "--host", "127.0.0.1", "--port",
                                      std::to_string(*gpu_port), "--spec", c.spec}});
  // numoe-gpu's per-worker sequence bound must admit the workers' --max-seqs.
  if (c.max_seqs > 256) gpu->args.insert(gpu->args.end(), {"--max-sequences", std::to_string(c.max_seqs)});
  if (c.drafter_experts != "worker") gpu->args.insert(gpu->args.end(), {"--drafter-experts", c.drafter_experts});
  std::vector<Child*> workers;
  std::vector<std::string> worker_addrs;
  for (size_t i = 0; i < slots->size(); ++i) {
    const WorkerPlacement& s = (*slots)[i];
    auto port = FreePort();
    if (!port.ok()) return fail(port.status());
    std::vector<std::string> args = {"--model",     model, "--gpu", gpu_addr, "--host", "127.0.0.1",
                                     "--port",      std::to_string(*port), "--worker-id",
                                     absl::StrCat("worker-", i)};
    if (c.no_numa_bind || s.nodes.empty()) {
      args.push_back("--no-numa-bind");
    } else {
      args.insert(args.end(), {"--numa-node", Join(s.nodes)});
    }
    if (!s.thread_cpus.empty()) args.insert(args.end(), {"--cpus", Join(s.thread_cpus)});
    if (s.threads > 0) args.insert(args.end(), {"--threads", std::to_string(s.threads)});
    if (c.max_seqs > 0) args.insert(args.end(), {"--max-seqs", std::to_string(c.max_seqs)});
    if (c.max_step_tokens > 0) args.insert(args.end(), {"--max-step-tokens", std::to_string(c.max_step_tokens)});
    if (c.prefill_chunk >= 0) args.insert(args.end(), {"--prefill-chunk", std::to_string(c.prefill_chunk)});
    args.insert(args.end(), {"--spec", c.spec});
    if (c.spec_depth > 0) args.insert(args.end(), {"--spec-depth", std::to_string(c.spec_depth)});
    if (c.spec_adaptive) args.push_back("--spec-adaptive");
    if (c.drafter_experts != "worker") args.insert(args.end(), {"--drafter-experts", c.drafter_experts});
    workers.push_back(sup.Add(Child{.name = absl::StrCat("numoe-worker-", i),
                                    .tier = 1,
                                    .binary = bin + "/numoe-worker",
                                    .args = args}));
    worker_addrs.push_back(absl::StrCat("127.0.0.1:", *port));
  }

  Status failure;
  auto stop = [&](int sig) {
    NLOG(INFO) << "numoe serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM") << ", stopping every process";
    sup.StopAll();
    return 0;
  };
  // numoe-gpu first: workers register with it.
  if (Status st = sup.Start(gpu); !st.ok()) return fail(st);
  if (int r = sup.WaitReady({gpu}, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));
  for (Child* w : workers) {
    if (Status st = sup.Start(w); !st.ok()) return (sup.StopAll(), fail(st));
  }
  if (int r = sup.WaitReady(workers, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));

  std::string ready_line;
  if (c.no_router) {
    std::string list;
    for (const auto& a : worker_addrs) list += (list.empty() ? "" : ",") + a;
    ready_line = absl::StrCat("numoe serve ready: workers (gRPC numoe.v1.Worker) ", list, ", numoe-gpu ", gpu_addr,
                              " (--no-router)");
  } else {
    std::string list;
    for (const auto& a : worker_addrs) list += (list.empty() ? "" : ",") + a;
    const std::string ready_file = std::filesystem::temp_directory_path() /
                                   absl::StrCat("numoe-serve-", getpid(), "-router.ready");
    Child* router = sup.Add(Child{.name = "numoe-router",
                                  .tier = 2,
                                  .binary = bin + "/numoe-router",
                                  .args = {"--model", model, "--workers", list, "--host", c.host, "--port",
                                           std::to_string(c.port), "--grpc-port", std::to_string(c.grpc_port),
                                           "--ready-file", ready_file, "--drain-timeout",
                                           absl::StrCat(std::max(c.stop_timeout_s - 2.0, 0.1))},
                                  .ready_file = ready_file});
    if (Status st = sup.Start(router); !st.ok()) return (sup.StopAll(), fail(st));
    if (int r = sup.WaitReady({router}, &failure); r != 0) return r > 0 ? stop(r) : (sup.StopAll(), fail(failure));
    ready_line = absl::StrCat("numoe serve ready: REST http://", c.host, ":", c.port, "/v1  gRPC ", c.host, ":",
                              c.grpc_port, "  (", workers.size(), " worker(s), ", c.backend, " backend)");
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
  p.AddString("backend", "cpu|cuda", "numoe-gpu's model backend", &c.backend);
  p.AddString("host", "ADDR", "address the router binds (REST and gRPC)", &c.host);
  p.AddInt("port", "N", "REST port", &c.port, 0, 65535);
  p.AddInt("grpc-port", "N", "gRPC port", &c.grpc_port, 0, 65535);
  p.AddInt("threads-per-worker", "N", "expert kernel threads per worker (0 = its CPUs)", &c.threads_per_worker, 0,
           4096);
  p.AddInt("max-seqs", "N", "numoe-worker --max-seqs (0 = its default)", &c.max_seqs, 0, 4096);
  // 16384: the most numoe-gpu accepts per worker step (GpuServerOptions::max_step_tokens).
  p.AddInt("max-step-tokens", "N", "numoe-worker --max-step-tokens (0 = its default)", &c.max_step_tokens, 0, 16384);
  p.AddInt("prefill-chunk", "N", "numoe-worker --prefill-chunk (-1 = its default)", &c.prefill_chunk, -1, 65536);
  p.AddString("spec", "auto|none|dspark|mtp|ngram",
              "speculative decoding (numoe-gpu and every worker): auto = the checkpoint's drafter (dspark with DSpark "
              "stages, mtp with MTP stages, else none; --backend cuda has no mtp); ngram drafts from the prompt and "
              "generated text (no weights); none turns it off",
              &c.spec);
  p.AddInt("spec-depth", "K", "draft tokens per step (0 = the checkpoint's dspark_block_size, else 5); any "
           "--max-seqs x --spec-depth runs, drafts share --max-step-tokens", &c.spec_depth, 0, 16);
  p.AddFlag("spec-adaptive", "adapt each sequence's draft depth from its recent acceptance (up to --spec-depth)",
            &c.spec_adaptive);
  p.AddString("drafter-experts", "worker|gpu",
              "--backend cuda with DSpark: where the drafter stages' routed experts run (numoe-gpu --drafter-experts): "
              "worker (default) or gpu (copied to the GPU, 9.6 GiB at V4-Flash width, faster drafting)",
              &c.drafter_experts);
  p.AddFlag("no-numa-bind", "start workers with --no-numa-bind (no NUMA rights, e.g. containers)", &c.no_numa_bind);
  p.AddFlag("no-router", "start numoe-gpu and the workers only (the ready line lists the workers)", &c.no_router);
  p.AddString("log-dir", "DIR", "write each child's log to DIR/<name>.log (default: this terminal's stderr)",
              &c.log_dir);
  p.AddDouble("stop-timeout", "S", "on shutdown, SIGKILL children still running after this long", &c.stop_timeout_s,
              0.1, 3600);
  p.AddDouble("startup-timeout", "S", "give up when not everything is ready after this long", &c.startup_timeout_s, 1,
              86400);
  int rc = 0;
  if (!p.ParseOrExit(argc, argv, &rc)) return rc;
  return Serve(c);
}

}  // namespace numoe::cli
