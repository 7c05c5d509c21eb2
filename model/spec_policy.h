// The one policy for --spec: which model drafter numoe-gpu loads and which drafter the workers' engines
// use, decided from the flags, the checkpoint's drafter (Checkpoint::drafter()) and what the backend can
// run. `numoe serve` (before any child starts), numoe-gpu (before any weight is loaded) and numoe-worker
// (before loading, then against what numoe-gpu declared) all call it, so the rules and their messages
// exist once. Every error names the flag and says what to change.
//
//   --spec auto    the checkpoint's drafter (dspark with DSpark stages, mtp with MTP stages) when the backend
//                  runs it, else none (SpecPlan::note says why)
//   --spec dspark  refused when the checkpoint has no DSpark stages or the backend cannot run them
//   --spec mtp     the same for MTP stages
//   --spec ngram   no weights: the workers draft from the prompt and generated text, numoe-gpu verifies
//   --spec none    off
#pragma once

#include <cstdint>
#include <string>

#include "common/checkpoint.h"
#include "common/choices.h"
#include "common/config.h"
#include "common/status.h"
#include "model/backend.h"
#include "model/spec.h"

namespace numoe {

// What a backend can draft with, known before it loads anything. Empty reasons = it can.
struct DrafterSupport {
  std::string backend;    // "cpu" / "cuda", named in messages; "" = unknown (a worker: numoe-gpu decides)
  std::string no_dspark;  // why it cannot run a DSpark drafter
  std::string no_mtp;     // why it cannot run an MTP drafter
};
// The CPU backend runs both drafters; the CUDA backend has no MTP drafter and runs DSpark with tp 1 only.
DrafterSupport KnownDrafterSupport(Backend backend, int64_t tp);

// The checkpoint's side of the decision (what its messages name).
struct CheckpointDrafter {
  std::string model_dir;
  SpecMethod method = SpecMethod::kNone;  // Checkpoint::drafter()
  int64_t mtp_stages = 0;
  int64_t dspark_block_size = 0;
};
CheckpointDrafter DrafterOf(const Checkpoint& ckpt, const std::string& model_dir);

struct SpecFlags {
  SpecChoice spec = SpecChoice::kAuto;
  int64_t depth = 0;  // 0 = the checkpoint's dspark_block_size, else 5
  bool adaptive = false;
};

struct SpecPlan {
  SpecChoice requested = SpecChoice::kAuto;
  SpecMethod load = SpecMethod::kNone;  // the model drafter numoe-gpu loads: kNone, kDspark or kMtp
  // config.method: the drafter the engine uses (kNone ... kNgram); for --spec auto on a worker it is
  // `load` until CheckSpecAgainstGpu replaces it with numoe-gpu's. config.depth resolved and validated.
  SpecConfig config;
  std::string note;  // --spec auto found a drafter the backend cannot run: why ("" otherwise)
};

StatusOr<SpecPlan> ResolveSpec(const SpecFlags& flags, const CheckpointDrafter& ckpt, const DrafterSupport& backend);

// numoe-gpu, after loading: the backend loaded the drafter the plan asked for, and verifies drafts when
// the plan drafts at all (Capabilities::verify). `backend` is named in the messages.
Status CheckLoadedDrafter(const SpecPlan& plan, const Capabilities& caps, const std::string& backend);

// Who runs the model a spec is checked against: what CheckSpecAgainstModel's messages name and tell to change.
enum class ModelSide {
  kNumoeGpu,     // a worker's engine: numoe-gpu runs the model (its declared capabilities)
  kThisProcess,  // the backend in this process (numoe generate, numoe-bench spec)
};

// The rules a resolved spec config (config.method, never auto) must meet against the model's declared
// capabilities, checked once here: ValidateSpec; a drafting method needs Capabilities::verify; kDspark /
// kMtp need that drafter loaded (Capabilities::drafter) and depth <= MaxDraftsPerItem (model/step.h).
// kNone always passes. Codes: InvalidArgument for a bad depth, FailedPrecondition for what the model side
// lacks. CheckSpecAgainstGpu, the worker's engine (engine::CheckSpec) and GenerateBatch call it.
Status CheckSpecAgainstModel(const SpecConfig& spec, const Capabilities& model, ModelSide side);

// numoe-worker, after registering: the plan against numoe-gpu's declared capabilities (from the channel's
// geometry, ChannelCapabilities). Resolves --spec auto to numoe-gpu's drafter when this worker loaded the
// drafter's experts (else none), then CheckSpecAgainstModel.
Status CheckSpecAgainstGpu(SpecPlan* plan, const Capabilities& gpu);

// --drafter-experts gpu needs the CUDA backend (the CPU backend runs the drafter's experts on the workers).
Status CheckDrafterExperts(DrafterExperts where, Backend backend);

}  // namespace numoe
