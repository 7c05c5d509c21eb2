// numoe-gpu's command line, defined once: AddGpuFlags registers every flag onto a GpuAppConfig, GpuArgv
// writes a GpuAppConfig back as the argv that parses to it (used by deploy/launch.h for `numoe serve` and
// `numoe plan --emit`).
#pragma once

#include <string>
#include <vector>

#include "common/args.h"
#include "gpu_service/gpu_app.h"

namespace numoe::gpu {

// Binds every numoe-gpu flag to a field of `c`; the fields' current values are the defaults.
void AddGpuFlags(ArgParser& p, GpuAppConfig* c);

// The flags of the fields of `c` that differ from a default GpuAppConfig (the binary name not included).
std::vector<std::string> GpuArgv(const GpuAppConfig& c);

// --merge-lanes, defined once for numoe-gpu, `numoe serve` / `numoe plan` (deploy/launch.h) and numoe-bench:
// `what` prefixes the help ("" for numoe-gpu itself).
void AddMergeLanesFlag(ArgParser& p, const std::string& what, MergeLanes* out);

// Settles tp and gpus, the same way for numoe-gpu and for the launchers that start it: --gpus LIST gives
// tp its size (a --tp other than 1 must agree); both need --backend cuda (past auto) when they ask for more
// than the default GPU; ids are distinct, and below `cuda_devices` when that is known (>= 0). Errors name
// the flags.
Status ResolveGpus(GpuAppConfig* c, int cuda_devices);

}  // namespace numoe::gpu
