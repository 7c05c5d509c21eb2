#include "model/spec_policy.h"

#include "absl/strings/str_cat.h"
#include "model/step.h"

namespace numoe {
namespace {

SpecMethod MethodOf(SpecChoice c) {
  switch (c) {
    case SpecChoice::kDspark: return SpecMethod::kDspark;
    case SpecChoice::kMtp: return SpecMethod::kMtp;
    case SpecChoice::kNgram: return SpecMethod::kNgram;
    case SpecChoice::kAuto:
    case SpecChoice::kNone: break;
  }
  return SpecMethod::kNone;
}

bool IsModelDrafter(SpecMethod m) { return m == SpecMethod::kDspark || m == SpecMethod::kMtp; }

const std::string& WhyNot(const DrafterSupport& s, SpecMethod m) {
  return m == SpecMethod::kMtp ? s.no_mtp : s.no_dspark;
}

}  // namespace

DrafterSupport KnownDrafterSupport(Backend backend, int64_t tp) {
  DrafterSupport s;
  s.backend = ChoiceName(backend);
  if (backend == Backend::kCuda) {
    s.no_mtp = "the CUDA backend has no MTP drafter";
    if (tp != 1) s.no_dspark = "the CUDA backend runs the DSpark drafter with --tp 1 only";
  }
  return s;
}

CheckpointDrafter DrafterOf(const Checkpoint& ckpt, const std::string& model_dir) {
  return CheckpointDrafter{.model_dir = model_dir,
                           .method = ckpt.drafter(),
                           .mtp_stages = ckpt.mtp_stages(),
                           .dspark_block_size = ckpt.config().dspark_block_size};
}

StatusOr<SpecPlan> ResolveSpec(const SpecFlags& flags, const CheckpointDrafter& ckpt, const DrafterSupport& backend) {
  SpecPlan plan;
  plan.requested = flags.spec;
  const SpecMethod own = ckpt.method;
  if (flags.spec == SpecChoice::kAuto) {
    if (IsModelDrafter(own)) {
      if (const std::string& why = WhyNot(backend, own); !why.empty()) {
        plan.note = absl::StrCat("the checkpoint has a ", SpecMethodName(own), " drafter, but ", why,
                                 ": no model drafter");
      } else {
        plan.load = own;
      }
    }
    plan.config.method = plan.load;
  } else {
    const SpecMethod m = MethodOf(flags.spec);
    const char* name = ChoiceName(flags.spec);
    if (IsModelDrafter(m)) {
      if (const std::string& why = WhyNot(backend, m); !why.empty()) {
        return absl::FailedPreconditionError(
            absl::StrCat("--spec ", name, ": ", why, "; use --spec ngram or none, or --backend cpu"));
      }
      if (own != m) {
        const bool none = own == SpecMethod::kNone;
        return absl::FailedPreconditionError(absl::StrCat(
            "--spec ", name, ": ", ckpt.model_dir, " has ",
            none ? std::string("no drafter stages") : absl::StrCat("a ", SpecMethodName(own), " drafter"), " (",
            ckpt.mtp_stages, " mtp.* stages, dspark_block_size ", ckpt.dspark_block_size, "); use --spec ",
            none ? std::string("ngram or none") : absl::StrCat(SpecMethodName(own), ", ngram or none")));
      }
      plan.load = m;
    }
    plan.config.method = m;
  }
  plan.config.depth = flags.depth > 0 ? flags.depth : (ckpt.dspark_block_size > 0 ? ckpt.dspark_block_size : 5);
  plan.config.adaptive = flags.adaptive;
  if (Status st = ValidateSpec(plan.config); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec-depth: ", st.message()));
  }
  return plan;
}

Status CheckLoadedDrafter(const SpecPlan& plan, const Capabilities& caps, const std::string& backend) {
  const char* name = SpecMethodName(plan.config.method);
  if (plan.load != SpecMethod::kNone && caps.drafter != plan.load) {
    return absl::UnimplementedError(absl::StrCat("--spec ", name, ": the ", backend, " backend loaded no ", name,
                                                 " drafter for this checkpoint; use --spec ngram or none"));
  }
  if (!caps.verify && plan.config.method != SpecMethod::kNone) {
    return absl::UnimplementedError(absl::StrCat("--spec ", name, ": the ", backend,
                                                 " backend cannot verify drafts yet (no Rollback); use --spec none"));
  }
  return absl::OkStatus();
}

Status CheckSpecAgainstModel(const SpecConfig& s, const Capabilities& model, ModelSide side) {
  if (s.method == SpecMethod::kNone) return absl::OkStatus();
  const bool gpu = side == ModelSide::kNumoeGpu;
  const char* who = gpu ? "numoe-gpu" : "the model";
  const char* name = SpecMethodName(s.method);
  if (Status st = ValidateSpec(s); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--spec ", name, ": ", st.message(), " (set --spec-depth)"));
  }
  const SpecMethod drafter = IsModelDrafter(model.drafter) ? model.drafter : SpecMethod::kNone;
  if (IsModelDrafter(s.method) && drafter != s.method) {
    const std::string other = drafter == SpecMethod::kNone ? "ngram or none" : SpecMethodName(drafter);
    return absl::FailedPreconditionError(
        gpu ? absl::StrCat("--spec ", name, ": numoe-gpu drafts with ", SpecMethodName(drafter),
                           "; start numoe-gpu with --spec ", name, " (or this worker with --spec ", other, ")")
            : absl::StrCat("--spec ", name, ": the model drafts with ", SpecMethodName(drafter), " (load it with its ",
                           name, " drafter, or use --spec ", other, ")"));
  }
  if (!model.verify) {
    return absl::FailedPreconditionError(
        absl::StrCat("--spec ", name, ": ", who, "'s backend cannot verify drafts; use --spec none"));
  }
  if (const int64_t most = MaxDraftsPerItem(model); IsModelDrafter(s.method) && s.depth > most) {
    return absl::InvalidArgumentError(absl::StrCat("--spec-depth ", s.depth, ": ", who, " drafts at most ", most,
                                                   " tokens per step; lower --spec-depth"));
  }
  return absl::OkStatus();
}

Status CheckSpecAgainstGpu(SpecPlan* plan, const Capabilities& gpu) {
  SpecConfig& s = plan->config;
  if (plan->requested == SpecChoice::kAuto) {
    s.method = plan->load != SpecMethod::kNone && IsModelDrafter(gpu.drafter) ? gpu.drafter : SpecMethod::kNone;
  }
  return CheckSpecAgainstModel(s, gpu, ModelSide::kNumoeGpu);
}

Status CheckDrafterExperts(DrafterExperts where, Backend backend) {
  if (where == DrafterExperts::kGpu && backend != Backend::kCuda) {
    return absl::InvalidArgumentError(
        "--drafter-experts gpu needs --backend cuda (the CPU backend's drafter experts run on the workers)");
  }
  return absl::OkStatus();
}

}  // namespace numoe
