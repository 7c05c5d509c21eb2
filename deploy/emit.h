// Launch files for a Plan: systemd units or a Kubernetes manifest, ready to edit.
//
// systemd (one unit per process): numoe-gpu.service, numoe-worker-<i>.service (numactl binding from the
// plan plus the same binding as CPUAffinity=/NUMAPolicy=/NUMAMask=), numoe-router.service, and
// numoe.target that starts them all.
// Kubernetes (numoe.yaml): one Pod per worker bound to its node(s) with numactl, one numoe-gpu Pod per
// host, the router as a Deployment behind a Service.
//
// The daemons' command lines use --model, --numa-node, --threads, --gpu-addr, --port (and the router's
// --workers); they follow `numoe-worker --help`, whose flags are not final yet (issue #4), and the files
// say so in a comment.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "deploy/planner.h"

namespace numoe::deploy {

struct EmitOptions {
  std::string model_path = "/path/to/model";  // --model of every daemon (a checkpoint directory)
  std::string bin_dir = "/usr/local/bin";      // where numoe-gpu, numoe-worker, numoe-router live
  std::string numactl = "/usr/bin/numactl";
  std::string host = "127.0.0.1";              // address the daemons use to reach each other
  int gpu_port = 50051;                        // numoe-gpu's gRPC control port
  int worker_base_port = 50061;                // worker i listens on worker_base_port + i
  int router_port = 8000;                      // the router's HTTP/gRPC front door
  int gpu_numa_node = -1;                      // node numoe-gpu's threads run on; -1 = the first node
  std::string image = "numoe:latest";          // Kubernetes container image
  std::string k8s_hostname = "HOSTNAME";       // kubernetes.io/hostname of the machine the plan is for
};

struct EmittedFile {
  std::string name;     // file name inside the output directory
  std::string content;
};

// Pure renderers (tests read these); FailedPrecondition when the plan has no workers.
StatusOr<std::vector<EmittedFile>> RenderSystemd(const Plan& plan, const EmitOptions& options);
StatusOr<std::vector<EmittedFile>> RenderKubernetes(const Plan& plan, const EmitOptions& options);

// Writes the files into `dir` (created if missing). Existing files are not overwritten unless
// `overwrite`: AlreadyExists names the first one (they may hold your edits). Returns the paths written.
StatusOr<std::vector<std::string>> WriteEmittedFiles(const std::vector<EmittedFile>& files, const std::string& dir,
                                                     bool overwrite);

}  // namespace numoe::deploy
