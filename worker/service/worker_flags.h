// numoe-worker's command line, defined once: AddWorkerFlags registers every flag onto a WorkerAppConfig,
// and WorkerArgv writes a WorkerAppConfig back as the argv that parses to it. worker/main.cc parses with
// the first; `numoe serve` and `numoe plan --emit` (deploy/launch.h) build their command lines with the
// second, so the launchers cannot drift from the daemon.
#pragma once

#include <string>
#include <vector>

#include "common/args.h"
#include "worker/service/worker_app.h"

namespace numoe::worker {

// Binds every numoe-worker flag to a field of `c`; the fields' current values are the defaults.
void AddWorkerFlags(ArgParser& p, WorkerAppConfig* c);

// --sim-expert-gbps G, defined here once and registered by numoe-worker, `numoe serve` / `numoe plan`
// (deploy/launch.h) and `numoe-bench decode` alike: G must be a finite number in (0, kMaxSimExpertGbps];
// leaving the flag out keeps `*gbps` at 0 (the real experts). `help` is the flag's help text.
inline constexpr double kMaxSimExpertGbps = 1e5;
void AddSimExpertGbpsFlag(ArgParser& p, const std::string& help, double* gbps);
// --micro-batches N is in [1, kMaxMicroBatches].
inline constexpr int64_t kMaxMicroBatches = 2;

// numoe-worker's help text of the flag (the launchers say where it goes, then this).
extern const char kSimExpertGbpsHelp[];

// The flags of the fields of `c` that differ from a default WorkerAppConfig (the binary name not included).
std::vector<std::string> WorkerArgv(const WorkerAppConfig& c);

}  // namespace numoe::worker
