#include "worker/service/worker_flags.h"

#include <charconv>
#include <cmath>

#include "absl/strings/numbers.h"
#include "common/topology.h"

namespace numoe::worker {

const char kSimExpertGbpsHelp[] =
    "simulated routed experts: load none (no arena, no repack) and, for each MoE call, sleep for the bytes of the "
    "distinct experts its rows are routed to divided by G GB/s, then return zeros (stands in for workers faster "
    "than, or more than, this machine has; the output tokens are not the model's)";

void AddSimExpertGbpsFlag(ArgParser& p, const std::string& help, double* gbps) {
  p.AddValue(
      "sim-expert-gbps", "G", help,
      [gbps](const std::string& v) -> Status {
        double x = 0;
        if (!absl::SimpleAtod(v, &x) || !std::isfinite(x)) {
          return absl::InvalidArgumentError(absl::StrCat("--sim-expert-gbps: '", v, "' is not a finite number"));
        }
        if (x <= 0 || x > kMaxSimExpertGbps) {
          return absl::InvalidArgumentError(absl::StrCat("--sim-expert-gbps: ", v, " GB/s is out of range (0, ",
                                                         kMaxSimExpertGbps,
                                                         "]; leave the flag out to run the real experts"));
        }
        *gbps = x;
        return absl::OkStatus();
      },
      [gbps] {
        if (*gbps == 0) return std::string();  // off: not written
        char buf[64];
        const auto r = std::to_chars(buf, buf + sizeof(buf), *gbps);  // shortest text that parses back exactly
        return std::string(buf, r.ptr);
      });
}

// The placement flags come right after --model, so a launch file's command reads model, binding, wiring.
void AddWorkerFlags(ArgParser& p, WorkerAppConfig* c) {
  p.AddString("model", "DIR", "checkpoint directory (the same one numoe-gpu loads)", &c->model_dir, true);
  p.AddIntList("numa-node", "N[,N...]", "bind threads and memory to these NUMA node(s) (several: interleaved)",
               &c->numa_nodes);
  p.AddFlag("no-numa-bind", "do not bind (machines or containers without NUMA rights)", &c->no_numa_bind);
  p.AddInt("threads", "N", "expert kernel threads (0 = one per --cpus CPU, else one per CPU of the bound nodes)",
           &c->threads, 0, 4096);
  p.AddValue(
      "cpus", "LIST",
      "pin kernel thread i to the i-th of these CPUs, e.g. 0-11,96-107 (one per thread; without it the threads run "
      "unpinned on the nodes' CPUs)",
      [c](const std::string& v) -> Status {
        ASSIGN_OR_RETURN(c->cpus, ParseCpuList(v, "--cpus"));
        return absl::OkStatus();
      },
      [c] { return c->cpus.empty() ? std::string() : FormatCpuList(c->cpus); });
  p.AddString("gpu", "HOST:PORT", "numoe-gpu's gRPC address", &c->gpu_address);
  p.AddString("host", "ADDR", "address to listen on", &c->host);
  p.AddInt("port", "N", "gRPC port of the Worker service (0 = any free port)", &c->port, 0, 65535);
  p.AddInt("max-seqs", "N", "sequences running at once", &c->max_seqs, 1, 4096);
  p.AddInt("max-step-tokens", "N", "token budget of one step (decode tokens + prefill chunks)", &c->max_step_tokens,
           1, 65536);
  p.AddInt("prefill-chunk", "N", "prompt tokens of one sequence per step (0 = up to the budget)", &c->prefill_chunk,
           0, 65536);
  p.AddInt("max-queue", "N", "requests waiting beyond the running ones (then RESOURCE_EXHAUSTED)", &c->max_queue, 0,
           1000000);
  p.AddInt("default-max-tokens", "N", "max_new_tokens of requests that leave it 0", &c->default_max_tokens, 1,
           10000000);
  p.AddString("worker-id", "ID", "name reported to numoe-gpu and in stats (default worker-n<node>-<pid>)",
              &c->worker_id);
  p.AddInt("gpu-wait-ms", "MS", "keep retrying registration this long while numoe-gpu starts", &c->gpu_wait_ms, 0,
           3600000);
  p.AddEnum("experts",
            "routed experts: packed for the CPU kernels (NUMOE_ISA forces an ISA), or fp32 reference (small models)",
            &c->experts);
  p.AddEnum("spec",
            "speculative decoding: auto = numoe-gpu's model drafter when it loaded one (this worker then also "
            "holds the drafter stages' routed experts), else none; dspark/mtp must match numoe-gpu's --spec; "
            "ngram drafts here from prompt + generated text and numoe-gpu verifies",
            &c->spec);
  p.AddInt("spec-depth", "K", "draft tokens per step (0 = the checkpoint's dspark_block_size, else 5)",
           &c->spec_depth, 0, 16);
  p.AddEnum("drafter-experts",
            "where numoe-gpu runs the model drafter's routed experts: worker (this process loads them) or gpu "
            "(numoe-gpu --drafter-experts gpu: not loaded here; must match numoe-gpu, checked at registration)",
            &c->drafter_experts);
  p.AddFlag("spec-adaptive", "adapt each sequence's depth from its recent acceptance (up to --spec-depth)",
            &c->spec_adaptive);
  AddSimExpertGbpsFlag(p, kSimExpertGbpsHelp, &c->sim_expert_gbps);
  p.AddInt("micro-batches", "N",
           "split the running sequences into N micro-batches, each its own session and lane in numoe-gpu, so the "
           "GPU runs one micro-batch's layers while this worker's CPUs compute the other's experts (their expert "
           "calls take turns on the one thread pool); a sequence stays in its micro-batch. 1 = one batch per step",
           &c->micro_batches, 1, kMaxMicroBatches);
  p.AddInt("prefill-lane-tokens", "N",
           "prompts of at least N tokens prefill in a lane of their own (one more numoe-gpu session sharing this "
           "worker's sequences) beside the decode steps, which no longer wait for a prompt chunk's pass; the "
           "sequence decodes with the others once its prompt is done. 0 = off (prompt chunks ride in the steps)",
           &c->prefill_lane_tokens, 0, int64_t{1} << 30);
  p.AddInt("prefill-lane-piece-rows", "N",
           "the prefill lane's expert calls computed here run in pieces of at most N rows, and the decode steps' "
           "calls waiting go first between pieces (0 = whole calls)",
           &c->prefill_lane_piece_rows, 0, 65536);
}

std::vector<std::string> WorkerArgv(const WorkerAppConfig& c) { return ArgvOf(c, AddWorkerFlags); }

}  // namespace numoe::worker
