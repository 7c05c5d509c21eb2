// The backend contracts of the V4 forward pass.
//
// A decode/prefill step runs the non-expert model (ModelBackend: CPU or CUDA) and, at every layer, hands
// the routed-expert part to an ExpertBackend (the worker: linked in-process, or across processes over the
// shared-memory channel). Both interfaces are deliberately small so implementations are interchangeable.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "model/sampling.h"
#include "model/spec.h"

namespace numoe {

// The routed-expert work of one layer for one step: `rows` MoE inputs (post-norm hidden, fp32, [rows, D]),
// each routed to `top_k` experts (ids may repeat: duplicates are summed) with weights; the backend
// writes out[r] = Σ_k weights[r,k] · expert_{ids[r,k]}(x[r]) (no shared expert), [rows, D].
struct MoeRequest {
  int64_t layer = 0;  // main layer index (MTP/DSpark stages use num_hidden_layers + stage)
  int64_t rows = 0;
  int64_t top_k = 0;
  const float* x = nullptr;
  const int32_t* expert_ids = nullptr;
  const float* expert_weights = nullptr;
  float* out = nullptr;
  // [rows]: the model sequence (SequenceId) each row belongs to, so that a caller that merged several
  // clients' sequences into one step can split the rows by client (numoe-gpu's merged passes). Null when
  // the backend does not say.
  const int64_t* seqs = nullptr;
};

// GPU prefill: a worker's packed routed experts of every main layer in host memory (common/packed_layout.h:
// a layer is its experts back to back at `stride` bytes), so that a model backend can compute the routed
// experts of large steps itself, uploading layer after layer (ModelBackend::AttachHostExperts). `regions` are
// the mappings that hold the layers (what a backend registers for DMA). The owner keeps them mapped and
// unchanged until DetachHostExperts returned.
struct HostExperts {
  struct Region {
    const uint8_t* data = nullptr;
    int64_t bytes = 0;
  };
  std::vector<Region> regions;
  std::vector<const uint8_t*> layers;  // [num_hidden_layers]: expert 0 of each main layer
  int64_t num_experts = 0, hidden = 0, inter = 0, stride = 0;
  // Device passes of at least this many rows compute their routed experts in the model backend from these
  // layers instead of calling the ExpertBackend (0 = never). Read at every step: the owner may change it
  // between steps.
  int64_t min_rows = 0;
  int64_t layer_bytes() const { return num_experts * stride; }
};

// What ModelBackend::AttachHostExperts measured and took.
struct HostExpertsAttachment {
  double register_seconds = 0;  // pinning the regions for DMA
  double h2d_gbps = 0;          // host-to-device copy bandwidth from the regions (one layer, best of 3)
  int64_t device_bytes = 0;     // device memory held for it (one set for every attachment: layer buffers, scratch)
};

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  // Computes one layer's routed experts. Must not retain the pointers after returning.
  virtual Status RunRouted(const MoeRequest& request) = 0;
  // The lane the caller's steps run on, for a backend with Capabilities::lanes > 0 (0 otherwise).
  virtual int lane() const { return 0; }
  // These experts in host memory, for a model backend that computes large steps' experts itself (GPU
  // prefill: ModelBackend::AttachHostExperts); null when they are not (another process, not packed).
  virtual const HostExperts* host_experts() const { return nullptr; }
  // A pass that computes its routed experts in the model backend (GPU prefill) makes no RunRouted call, in
  // which its caller lets others use the model meanwhile (numoe-gpu's sessions on their lanes). When
  // WantsYield, the backend calls YieldModel between such a pass's layers with what it must wait for anyway
  // (`meanwhile`: its device work so far); the caller gives the model up while that runs (another lane's
  // step goes on, its kernels beside this lane's) and takes it back, and the backend resumes as after a
  // RunRouted (its lane). Returns what `meanwhile` returned.
  virtual bool WantsYield() const { return false; }
  // The caller's steps make way for others' (a worker's prefill lane): a backend with lanes runs them on a
  // stream of the least priority.
  virtual bool background() const { return false; }
  virtual Status YieldModel(const std::function<Status()>& meanwhile) { return meanwhile(); }
};

using SequenceId = int64_t;

// One sequence's part of a step: the new tokens at positions [position(seq), position(seq)+tokens).
struct SequenceStep {
  SequenceId seq = 0;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits for every new token (prefill tests, --logits-out) or only the last
  // Record what this step overwrites so Rollback can drop its trailing tokens (speculative verification).
  bool speculative = false;
};

// The checks every backend's Forward makes before it touches any state: a non-empty step, each sequence
// known (`position` returns its position, or NotFound) and present at most once, tokens present and in
// [0, vocab_size), and the model's context limit (max_position_embeddings, OutOfRange). Errors name the
// sequence. Backends add their own capacity checks after it.
Status ValidateSequenceSteps(std::span<const SequenceStep> steps, const ModelConfig& config,
                             const std::function<StatusOr<int64_t>(SequenceId)>& position);

// Logits of one sequence's step: [n, vocab] with n = tokens.size() when all_logits, else 1.
struct SequenceLogits {
  SequenceId seq = 0;
  int64_t rows = 0;
  std::vector<float> logits;
};

// Per-sequence state accounting (bytes actually held).
struct SequenceMemory {
  int64_t position = 0;           // tokens consumed so far
  int64_t fixed_bytes = 0;        // windows, pending buffers, overlap state
  int64_t growing_bytes = 0;      // compressed entries (grow with context)
  int64_t capacity_bytes = 0;     // allocated (>= used; chunked storage)
};

// A request for the model's own drafter (DSpark or MTP): `next_token` was just sampled for the position after
// the sequence's last consumed token; propose `depth` tokens after it.
struct DraftRequest {
  SequenceId seq = 0;
  int32_t next_token = 0;
  int64_t depth = 0;
  // Draws the drafts with SampleDraft (the Markov correction is sequential, and each draft counts for the
  // next one's penalties); null = greedy.
  Sampler* sampler = nullptr;
};

// The checks every drafter makes on one request before touching its sequence: depth >= 1 and next_token
// in [0, vocab_size). Errors name the field.
inline Status ValidateDraftRequest(const DraftRequest& q, int64_t vocab_size) {
  if (q.depth < 1) return absl::InvalidArgumentError(absl::StrCat("draft depth must be >= 1 (got ", q.depth, ")"));
  if (q.next_token < 0 || q.next_token >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token id ", q.next_token, " is out of range [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

struct DraftResult {
  SequenceId seq = 0;
  std::vector<int32_t> tokens;     // [depth]
  std::vector<float> logits;       // [depth, vocab]: the distributions the drafts were drawn from
  std::vector<float> confidence;   // [depth]: raw confidence logits
};

// What a backend can do, declared once at load time (callers never probe by calling a method and looking
// for Unimplemented).
struct Capabilities {
  // Runs speculative SequenceSteps and Rollback.
  bool verify = false;
  // The checkpoint's own drafter the backend loaded: kDspark (0731 stages), kMtp (preview MTP block) or
  // kNone. Draft() proposes with it.
  SpecMethod drafter = SpecMethod::kNone;
  // The most tokens of one speculative step (the last sampled token + drafts); 0 = no bound of the
  // backend's own (RunModelStep still caps drafts at kMaxDraftsPerItem).
  int64_t max_spec_tokens = 0;
  // Forward and Draft calls on different sequences may interleave at their ExpertBackend calls, one
  // thread computing at a time (the backend keeps no step state outside the call's own locals and the
  // sequences): numoe-gpu then runs other workers' steps while one worker computes its experts.
  bool interleaved_steps = false;
  // With interleaved_steps: 0 = any number of callers may interleave (the backend keeps no per-caller step
  // state: the CPU backend). N > 0 = the backend keeps step resources per lane (the CUDA backend: a stream,
  // scratch, staging and graphs each); callers interleave only on distinct lanes 1..N-1 (their
  // ExpertBackend::lane()), and every caller on lane 0 holds the model for whole steps.
  int64_t lanes = 0;
  // ForkSequence copies a sequence's state (n choices of one prompt prefill it once).
  bool fork = false;
  // ExportSequence / ImportSequence move a sequence's state to host memory and back (the prefix cache's
  // host tier), with pages of a positive multiple of this many positions; 0 = they are not implemented.
  int64_t export_align = 0;
};

// Host memory a backend's ExportSequence filled (pinned on CUDA, so the copies run at the link's speed),
// freed by the deleter it came with; shared by whoever holds it (the prefix cache shares pages).
struct HostBytes {
  std::shared_ptr<uint8_t[]> data;
  int64_t size = 0;
  const uint8_t* get() const { return data.get(); }
  // `n` bytes of ordinary heap memory (what the CPU backend and tests use).
  static HostBytes Heap(int64_t n);
};

// A sequence's state in host memory, split by how it is kept (docs/dsv4-architecture.md §2.7-2.8):
//  - pages[k]: everything the state appends for absolute positions [k·page_tokens, (k+1)·page_tokens) and
//    never rewrites (the CSA/HCA compressed entries and the indexer's keys; on CUDA the device's own pages of
//    them). Only whole pages: there are position / page_tokens of them. Two sequences that consumed the same
//    tokens up to a page's end hold byte-identical copies of it, so a host tier may keep one for both.
//  - rest: everything else, per sequence: the window rings, the compressors' pending blocks and overlap
//    halves, the drafter's rings, the tail of the compressed history past the last whole page.
// The bytes are the backend's own layout; only the backend that wrote them (same model, same options) reads
// them back.
struct HostState {
  int64_t position = 0;
  int64_t page_tokens = 0;
  std::vector<HostBytes> pages;
  HostBytes rest;
};

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;
  virtual StatusOr<SequenceId> CreateSequence() = 0;
  virtual Status ReleaseSequence(SequenceId seq) = 0;
  // Runs one step over several sequences at different positions; each sequence appears at most once.
  virtual Status Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                         std::vector<SequenceLogits>* out) = 0;
  virtual StatusOr<SequenceMemory> Memory(SequenceId seq) const = 0;
  // Drops the last `num_tokens` tokens of the sequence's most recent step, which must have been
  // speculative: every cache (windows, compressor pending buffers, overlap state, compressed and indexer
  // entries) is left exactly as if those tokens had never run.
  virtual Status Rollback(SequenceId seq, int64_t num_tokens) = 0;
  // A new sequence whose state is a copy of `parent`'s, every cache at the parent's position; the two then
  // run independently. The parent's last step must not have been speculative (FailedPrecondition), so
  // the copy has nothing to roll back. Only with Capabilities::fork.
  virtual StatusOr<SequenceId> ForkSequence(SequenceId parent) {
    (void)parent;
    return absl::UnimplementedError("this backend cannot fork sequences");
  }
  // Makes the sequence's last step final: its rejected tokens are rolled back and nothing will be, so what
  // Rollback would need is dropped and ForkSequence may copy the sequence (the prefix cache keeps a sequence
  // whose last step was speculative this way). Unimplemented where the backend cannot; a no-op after a
  // step that was not speculative.
  virtual Status Settle(SequenceId seq) {
    (void)seq;
    return absl::UnimplementedError("this backend cannot settle a speculative step");
  }
  // Copies `seq`'s state to host memory (HostState). Pages below `first_page` are left empty (size 0: the
  // caller already holds them, from a sequence that consumed the same tokens up to there). page_tokens must be
  // a positive multiple of capabilities().export_align; the sequence's last step must not have been
  // speculative (FailedPrecondition). The sequence is unchanged.
  virtual StatusOr<HostState> ExportSequence(SequenceId seq, int64_t page_tokens, int64_t first_page) {
    (void)seq;
    (void)page_tokens;
    (void)first_page;
    return absl::UnimplementedError("this backend cannot export sequences");
  }
  // A new sequence whose state is `state` (every page present), which ExportSequence of this backend made.
  // InvalidArgument when the bytes do not fit this model's layout; RESOURCE_EXHAUSTED when the backend has no
  // room (like CreateSequence).
  virtual StatusOr<SequenceId> ImportSequence(const HostState& state) {
    (void)state;
    return absl::UnimplementedError("this backend cannot import sequences");
  }
  // GPU prefill: prepares to compute routed experts from `experts` (not owned; valid and unchanged until
  // DetachHostExperts): registers its regions for DMA and measures the copy bandwidth. From then on a Forward
  // whose ExpertBackend's host_experts() is `experts` runs every device pass of at least experts->min_rows
  // rows without calling the ExpertBackend. Unimplemented where the backend cannot (the CPU backend); any
  // error leaves nothing attached.
  virtual StatusOr<HostExpertsAttachment> AttachHostExperts(const HostExperts* experts) {
    (void)experts;
    return absl::UnimplementedError("this backend computes no routed experts itself (GPU prefill needs CUDA)");
  }
  // Undoes AttachHostExperts (a no-op for experts never attached); the caller may unmap them afterwards.
  virtual void DetachHostExperts(const HostExperts* experts) { (void)experts; }
  virtual Capabilities capabilities() const = 0;
  SpecMethod drafter() const { return capabilities().drafter; }
  virtual Status Draft(std::span<const DraftRequest> requests, ExpertBackend* experts, std::vector<DraftResult>* out) {
    (void)requests;
    (void)experts;
    (void)out;
    return absl::UnimplementedError("this backend has no model drafter");
  }
  virtual int64_t vocab_size() const = 0;
};

}  // namespace numoe
