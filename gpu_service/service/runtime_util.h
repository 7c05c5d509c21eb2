// Small pieces shared by numoe-gpu and numoe-worker: the model fingerprint both sides compare at
// registration, absl <-> gRPC status conversion at the edge, the readiness notification that
// `numoe serve` waits for, and shutdown on SIGINT/SIGTERM.
#pragma once

#include <grpcpp/grpcpp.h>

#include <functional>
#include <string>

#include "common/status.h"

namespace numoe {

class Checkpoint;

// The checkpoint's own drafter, the default of --spec on numoe-gpu, numoe-worker and `numoe serve`:
// "dspark" (mtp.* stages and dspark_* config keys), "mtp" (mtp.* stages without DSpark config) or "none".
const char* CheckpointDrafter(const Checkpoint& ckpt);

// A stable hex digest of DIR/config.json and DIR/model.safetensors.index.json (or the single
// model.safetensors' size): equal for two processes that loaded the same checkpoint.
StatusOr<std::string> ModelFingerprint(const std::string& model_dir);

// absl and gRPC share the canonical status codes.
grpc::Status ToGrpcStatus(const Status& status);
Status FromGrpcStatus(const grpc::Status& status, const std::string& what);

// When the environment variable NUMOE_NOTIFY_FD names an open file descriptor (set by `numoe serve`),
// writes "READY <text>\n" to it and closes it. No-op otherwise.
void NotifyReady(const std::string& text);

// Blocks SIGINT/SIGTERM in this thread; call before starting other threads, so they inherit the mask and
// the signals wait for WaitForShutdownSignal.
void BlockShutdownSignals();
// Returns the signal number once SIGINT or SIGTERM arrives, or 0 as soon as `give_up()` turns true
// (polled every `poll_ms`; nullptr = never).
int WaitForShutdownSignal(const std::function<bool()>& give_up = nullptr, int poll_ms = 200);

}  // namespace numoe
