// The CPU backend of numoe-gpu: the non-expert DeepSeek-V4 model in fp32 on dequantized weights
// (the numerics of transformers' DeepseekV4ForCausalLM). Routed experts go through an ExpertBackend.
//
// Thread-safety: one Forward at a time (the caller serialises steps); sequences are owned by the model.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "common/checkpoint.h"
#include "common/config.h"
#include "backends/cpu/compressor.h"
#include "backends/cpu/ops.h"
#include "model/backend.h"

namespace numoe {
class ThreadPool;
}

namespace numoe::cpu {

struct HyperConnW {
  std::vector<float> fn;     // [(2 + hc)·hc, hc·D]  (24 x 4D for hc = 4)
  std::vector<float> base;   // [(2 + hc)·hc]
  std::vector<float> scale;  // [3]
};

struct CompressorW {
  Linear wkv, wgate;        // [coff·dim, D]
  std::vector<float> ape;   // [rate, coff·dim]
  std::vector<float> norm;  // [dim]
};

struct AttentionW {
  AttnType type = AttnType::kSliding;
  int64_t rate = 0;
  Linear wq_a, wq_b, wkv, wo_a, wo_b;
  std::vector<float> q_norm, kv_norm, sink;
  CompressorW comp;                 // CSA / HCA
  CompressorW index_comp;           // CSA
  Linear index_wq_b, index_weights;  // CSA
};

struct FfnW {
  MoeType type = MoeType::kScored;
  Linear gate;
  std::vector<float> bias;        // scored layers (may be empty: zeros)
  std::vector<int32_t> tid2eid;   // hash layers [vocab, top_k]
  Linear shared_w1, shared_w3, shared_w2;
};

struct LayerW {
  std::vector<float> attn_norm, ffn_norm;
  HyperConnW hc_attn, hc_ffn;
  AttentionW attn;
  FfnW ffn;
};

struct ModelW {
  Linear embed, head;      // [vocab, D]; `head` stays empty when tied to the embedding
  bool tied_head = false;  // tie_word_embeddings: the head is `embed`
  const Linear& Head() const { return tied_head ? embed : head; }
  std::vector<float> norm;
  HyperConnW hc_head;  // fn [hc, hc·D], base [hc], scale [1]
  std::vector<LayerW> layers;
};

// The DSpark drafter's dense weights (stages mtp.0..S-1; docs/dsv4-architecture.md §4.2).
struct DsparkW {
  Linear main_proj;               // [D, T·D], T = number of target layers
  std::vector<float> main_norm;   // [D]
  std::vector<LayerW> stages;     // sliding attention (main rope) + scored MoE
  std::vector<float> norm;        // last stage: final norm [D]
  HyperConnW hc_head;             // last stage
  Linear markov_w1, markov_w2;    // [V, r]
  Linear confidence;              // [1, D + r] over [h_pre; markov_w1[prev]]
  std::vector<int64_t> target_layers;
  int32_t noise_token = 0;
};

// The preview-Flash MTP drafter's dense weights (one block `mtp.0`; docs/dsv4-architecture.md §4.1). The
// block input at position q+1 is e_proj(enorm(embed(t_{q+1}))) broadcast to the hc streams plus
// h_proj(hnorm(X_q[j])) per stream j, X_q = the target's last-layer residual streams at position q.
struct MtpW {
  LayerW block;                   // sliding attention (main rope) + scored MoE (experts: layer num_hidden_layers)
  Linear e_proj, h_proj;          // [D, D]
  std::vector<float> enorm, hnorm, norm;  // [D]
  HyperConnW hc_head;             // fn [hc, hc·D], base [hc], scale [1]
};

// Loads the dense (non-routed-expert) weights of the main layers: matrices stored as BF16 (embedding, head,
// gates, DSpark Markov/confidence heads, any other BF16 Linear) stay BF16, the rest is dequantized to fp32.
StatusOr<std::unique_ptr<ModelW>> LoadDenseWeights(const Checkpoint& ckpt);
// Loads the DSpark stages; NotFound when the checkpoint has none.
StatusOr<std::unique_ptr<DsparkW>> LoadDsparkWeights(const Checkpoint& ckpt);
// Loads the MTP block (stage mtp.0 of a checkpoint with MTP stages and no DSpark config); NotFound when the
// checkpoint has none. Further MTP stages, if any, are not used (depth > 1 applies mtp.0 recursively).
StatusOr<std::unique_ptr<MtpW>> LoadMtpWeights(const Checkpoint& ckpt);

struct CpuModelOptions {
  // Load the checkpoint's drafter and keep its per-sequence state up to date: DSpark when the checkpoint has
  // a DSpark config and stages, else the MTP block when it has MTP stages; NotFound when it has neither.
  bool drafter = false;
};

class CpuModel final : public ModelBackend {
 public:
  // `pool` may be null (single-threaded); it must outlive the model.
  static StatusOr<std::unique_ptr<CpuModel>> Create(const Checkpoint& ckpt, ThreadPool* pool,
                                                    const CpuModelOptions& options = {});
  ~CpuModel() override;

  StatusOr<SequenceId> CreateSequence() override;
  Status ReleaseSequence(SequenceId seq) override;
  Status Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                 std::vector<SequenceLogits>* out) override;
  StatusOr<SequenceMemory> Memory(SequenceId seq) const override;
  Status Rollback(SequenceId seq, int64_t num_tokens) override;
  Status Settle(SequenceId seq) override;
  // A deep copy of the parent's state (rings, compressor buffers and entries, drafter rings).
  StatusOr<SequenceId> ForkSequence(SequenceId parent) override;
  // A compact host copy: pages hold each compressor's entries (main, then indexer, layer by layer) of the
  // page's positions; the rest holds the rings, the compressors' pending state and entries past the last
  // whole page, and the drafter's state. export_align is the lcm of the layers' compress rates.
  StatusOr<HostState> ExportSequence(SequenceId seq, int64_t page_tokens, int64_t first_page) override;
  StatusOr<SequenceId> ImportSequence(const HostState& state) override;
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  // Verifies any speculative step; drafts per item are bounded only by kMaxDraftsPerItem (model/step.h).
  Capabilities capabilities() const override {
    return Capabilities{.verify = true,
                        .drafter = dspark_ != nullptr ? SpecMethod::kDspark
                                   : mtp_ != nullptr  ? SpecMethod::kMtp
                                                      : SpecMethod::kNone,
                        .max_spec_tokens = 0,
                        .interleaved_steps = true,
                        .fork = true,
                        .export_align = export_align_};
  }
  // DSpark: a block of `depth` drafts from one pass. MTP: `depth` sequential passes of the MTP block, each
  // on the previous pass's output streams and drafted token; the block's draft-time KV entries are
  // discarded afterwards (only Forward feeds its ring). MTP has no confidence head: DraftResult::confidence
  // stays empty.
  Status Draft(std::span<const DraftRequest> requests, ExpertBackend* experts,
               std::vector<DraftResult>* out) override;

  const ModelConfig& config() const { return cfg_; }
  // Bytes of dense weights the model holds (drafter included), and the BF16 part of them.
  struct WeightBytes {
    int64_t total = 0;
    int64_t bf16 = 0;
  };
  WeightBytes weight_bytes() const;
  // Debug/test hook: called with the residual streams [rows, hc, D] after the embedding (layer -1) and
  // after each layer, and the final normed hidden [rows, D] (layer == num_hidden_layers).
  using HiddenHook = std::function<void(int64_t layer, const std::vector<float>& x)>;
  void set_hidden_hook(HiddenHook hook) { hidden_hook_ = std::move(hook); }

 private:
  struct SeqState;
  struct Rows;
  CpuModel(ModelConfig cfg, std::unique_ptr<ModelW> w, std::unique_ptr<DsparkW> dspark, std::unique_ptr<MtpW> mtp,
           ThreadPool* pool);
  // DSpark: the target features of n rows ([n, T·D] layer-input stream means) -> each stage's ring.
  void FeedDrafter(const Rows& rows, const std::vector<float>& features);
  Status DraftDspark(std::span<const DraftRequest> requests, ExpertBackend* experts, std::vector<DraftResult>* out);
  // MTP: the step's target last-layer streams X [rows, hc, D] -> the MTP ring entries of the step's positions
  // (entry q+1 from X_q and token t_{q+1}) and the sequences' last-streams history.
  void FeedMtp(const Rows& rows, const std::vector<float>& X);
  // MTP block input [m, hc, D] from m token ids and m hidden stream sets [m, hc, D].
  void MtpInput(const int32_t* tokens, const float* hidden, int64_t m, float* x) const;
  Status DraftMtp(std::span<const DraftRequest> requests, ExpertBackend* experts, std::vector<DraftResult>* out);
  std::unique_ptr<SeqState> NewState() const;
  void HyperPre(const HyperConnW& hc, const float* x, int64_t n, float* u, float* post, float* comb) const;
  void HyperPost(const float* y, const float* post, const float* comb, int64_t n, float* x) const;
  // hc_head: collapses one row's streams x[hc, D] into h[D] (before the final norm).
  void CollapseStreams(const HyperConnW& hh, const float* x, float* h) const;
  Status Attention(int64_t layer, const Rows& rows, const float* x, float* out);
  void ProjectQueryKv(const AttentionW& a, const float* x, int64_t n, const int64_t* pos, const float* inv, float* qa,
                      float* q, float* kv) const;
  void OutputProjection(const AttentionW& a, const float* o, int64_t n, float* out) const;
  // Gate, routing, routed experts (via `experts`, as layer `expert_layer`) and the shared expert.
  // `seqs` [n]: each row's SequenceId (MoeRequest::seqs).
  Status Moe(const FfnW& f, int64_t expert_layer, int64_t n, const int32_t* tokens, const int64_t* seqs,
             const float* y, float* out, ExpertBackend* experts);

  ModelConfig cfg_;
  std::unique_ptr<ModelW> w_;
  std::unique_ptr<DsparkW> dspark_;
  std::unique_ptr<MtpW> mtp_;
  ThreadPool* pool_;
  std::vector<float> inv_freq_main_, inv_freq_compress_;
  int64_t export_align_ = 1;  // lcm of the compress rates (Capabilities::export_align)
  std::map<SequenceId, std::unique_ptr<SeqState>> seqs_;
  SequenceId next_id_ = 1;
  HiddenHook hidden_hook_;
};

}  // namespace numoe::cpu
