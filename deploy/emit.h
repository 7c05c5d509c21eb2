// Launch files for a Plan: systemd units or a Kubernetes manifest, ready to edit.
//
// systemd (one unit per process): numoe-gpu.service, numoe-worker-<i>.service (numactl binding from the
// plan plus the same binding as CPUAffinity=/NUMAPolicy=/NUMAMask=), numoe-router.service, and
// numoe.target that starts them all.
// Kubernetes (numoe.yaml): one Pod per worker bound to its node(s) with numactl, one numoe-gpu Pod per
// host, the router as a Deployment behind a Service.
//
// The daemons' command lines come from the launch plan `numoe serve` runs too (deploy/launch.h), written
// with each daemon's own flag definitions (WorkerArgv, GpuArgv, RouterArgv), so every flag the daemons
// need is there (numoe-gpu's --backend, --spec and --drafter-experts included) and each parses with the
// daemon's own parser. With LaunchOptions::no_numa_bind the commands have no numactl prefix and the
// workers run with --no-numa-bind (containers, machines without NUMA rights).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "deploy/launch.h"
#include "deploy/planner.h"

namespace numoe::deploy {

struct EmitOptions {
  // The daemons' configuration: --model (a checkpoint directory), the backend (resolved: kAuto is written
  // as auto), spec flags, addresses and ports (workers on worker_base_port + i).
  LaunchOptions launch{.model_dir = "/path/to/model", .backend = Backend::kCpu};
  std::string bin_dir = "/usr/local/bin";      // where numoe-gpu, numoe-worker, numoe-router live
  std::string numactl = "/usr/bin/numactl";
  int gpu_numa_node = -1;                      // node numoe-gpu's threads run on; -1 = the first node
  std::string image = "numoe:latest";          // Kubernetes container image
  std::string k8s_hostname = "HOSTNAME";       // kubernetes.io/hostname of the machine the plan is for
};

struct EmittedFile {
  std::string name;     // file name inside the output directory
  std::string content;
};

// Pure renderers (tests read these): the LaunchPlan of `plan.workers` under options.launch.
// FailedPrecondition when the plan has no workers.
StatusOr<std::vector<EmittedFile>> RenderSystemd(const Plan& plan, const EmitOptions& options);
StatusOr<std::vector<EmittedFile>> RenderKubernetes(const Plan& plan, const EmitOptions& options);

// Splits an ExecStart= command line into its words, undoing the units' quoting ("..." with \" and \\) and
// systemd's %% and $$ escapes; InvalidArgument for an unterminated quote. What reads a unit back (tests,
// a launcher without systemd) uses it.
StatusOr<std::vector<std::string>> SplitExecStart(const std::string& command);

// Writes the files into `dir` (created if missing). Existing files are not overwritten unless
// `overwrite`: AlreadyExists names the first one (they may hold your edits). Returns the paths written.
StatusOr<std::vector<std::string>> WriteEmittedFiles(const std::vector<EmittedFile>& files, const std::string& dir,
                                                     bool overwrite);

}  // namespace numoe::deploy
