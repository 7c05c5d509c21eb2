// Internal structures of the CUDA backend (cuda_model.cc, cuda_model_setup.cc): per-GPU weights, state
// layout and scratch. Not a public header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "common/config.h"
#include "backends/cuda/cuda_model.h"
#include "backends/cuda/device_memory.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/weights.h"

namespace numoe::cuda {

Status NcclError(ncclResult_t r, const char* what, const char* file, int line);
#define NUMOE_NCCL_RETURN_IF_ERROR(expr)                                          \
  do {                                                                            \
    const ncclResult_t numoe_nccl_r_ = (expr);                                    \
    if (numoe_nccl_r_ != ncclSuccess) {                                           \
      return ::numoe::cuda::NcclError(numoe_nccl_r_, #expr, __FILE__, __LINE__);  \
    }                                                                             \
  } while (0)

// Where one layer's state lives: byte offsets inside a sequence slot, CacheT offsets inside a page.
struct LayerState {
  int64_t ring_off = 0;
  int64_t c_pend_kv = 0, c_pend_gate = 0, c_prev_kv = 0, c_prev_gate = 0;
  int64_t i_pend_kv = 0, i_pend_gate = 0, i_prev_kv = 0, i_prev_gate = 0;
  int64_t c_page_off = 0, i_page_off = 0;
  int32_t epp = 0;  // entries per page of this layer's rate
  // Speculative log (bytes inside a slot's log region): the step's window keys CacheT [T, hd] and the first
  // log_comp_w columns of its compressor projections fp32 [T, log_comp_w] (main kv, main gate, and for CSA
  // the indexer's kv and gate: everything the compressor state is built from).
  int64_t log_kv_off = 0, log_comp_off = 0, log_comp_w = 0;
};

struct LayerDev {
  AttnType type = AttnType::kSliding;
  int rate = 0;
  bool qkv_fused = false;  // [wq_a; wkv] stacked into wq_a
  DevW wq_a, wkv, wq_b, wo_a, wo_b;  // wq_b: local heads; wo_a: ONE group (rows R); wo_b: local columns
  DevW comp;                          // [comp.wkv; comp.wgate; (CSA) idx.wkv; idx.wgate; idx.weights_proj]
  int64_t comp_width = 0, c_kv_col = 0, c_gate_col = 0, i_kv_col = 0, i_gate_col = 0, iw_col = 0;
  DevW index_wq_b;
  DevW gate;
  bool sh_fused = false;  // [w1; w3] stacked into sh_w1
  DevW sh_w1, sh_w3, sh_w2;  // local slices of the shared expert
  DevW hc_attn_fn, hc_ffn_fn;
  const float *attn_norm = nullptr, *ffn_norm = nullptr, *q_norm = nullptr, *kv_norm = nullptr, *sink = nullptr;
  const float *c_ape = nullptr, *c_norm = nullptr, *i_ape = nullptr, *i_norm = nullptr, *bias = nullptr;
  const float *hc_attn_base = nullptr, *hc_attn_scale = nullptr, *hc_ffn_base = nullptr, *hc_ffn_scale = nullptr;
  const int32_t* tid2eid = nullptr;
  LayerState st;
};

// The step metadata: one int32 block per pass, filled on the host (meta_h_) and copied whole to the device
// (Scratch::meta), kWords x rows_cap words. One layout for both copies and every pass (decode, prefill,
// verify, replay, draft).
struct StepMeta {
  static constexpr int64_t kWords = 9;
  int32_t* token;       // [rows_cap] token id of each row
  int32_t* pos;         // [rows_cap] position of each row
  int32_t* seq;         // [rows_cap] index of each row's sequence in `seqs`
  int32_t* seqs;        // [rows_cap][4] per sequence of the pass: StepSeq {slot, begin row, end row, start position}
  int32_t* logit_rows;  // [rows_cap] the rows whose logits are computed, in output order
  int32_t* spec_map;    // [rows_cap] row -> slot * spec_tokens + index within the step (speculative rows), or -1
  static StepMeta At(int32_t* base, int64_t rows_cap) {
    return {base, base + rows_cap, base + 2 * rows_cap, base + 3 * rows_cap, base + 7 * rows_cap,
            base + 8 * rows_cap};
  }
  static constexpr size_t Bytes(int64_t rows_cap) { return static_cast<size_t>(kWords * rows_cap) * sizeof(int32_t); }
  // Sequence i's entry of `seqs`.
  void SetSeq(int64_t i, int32_t slot, int64_t begin, int64_t end, int64_t start_pos) const {
    seqs[4 * i] = slot;
    seqs[4 * i + 1] = static_cast<int32_t>(begin);
    seqs[4 * i + 2] = static_cast<int32_t>(end);
    seqs[4 * i + 3] = static_cast<int32_t>(start_pos);
  }
};

// Device scratch for up to `rows` rows per pass (fixed addresses: CUDA graphs capture them).
struct Scratch {
  float *X = nullptr, *xn = nullptr, *y = nullptr, *mix = nullptr, *inv = nullptr, *post = nullptr, *comb = nullptr;
  float* hc_part = nullptr;  // HcMix's partial sums [min(rows, kHcMixMaxRows), kHcMixSplits, m + 1]
  float *qa = nullptr, *kv = nullptr, *q = nullptr, *o = nullptr, *z = nullptr, *comp = nullptr, *iq = nullptr;
  float *scores = nullptr, *glog = nullptr, *wts = nullptr, *shg = nullptr, *shh = nullptr, *sh = nullptr;
  float *routed = nullptr, *logits = nullptr, *hsel = nullptr;
  float* attn_part = nullptr;  // attention key-split partials for up to kSplitRows rows
  void* kvT = nullptr;
  void* q16 = nullptr;  // bf16 mode: q in bf16 for the tensor-core attention (AttnArgs::q16)
  int32_t *sel = nullptr, *ids = nullptr, *meta = nullptr;
  unsigned long long* greedy = nullptr;  // packed argmax keys (ArgmaxRows)
  int64_t qa_ld = 0, kv_ld = 0, shg_ld = 0;
  int64_t score_rows = 0, score_ld = 0;  // indexer scores buffer [score_rows, score_ld]
};

// attn_part holds key-split partials of kSplitRows rows x kMaxSplits splits: a pass splits its rows' keys
// up to kMaxSplits ways while rows x splits fits (AttentionSplits; 64 splits at one row made the combine
// cost more than the splits saved, H200).
constexpr int64_t kSplitRows = 16;
constexpr int64_t kMaxSplits = 16;

struct Rank {
  int index = 0;
  int device = 0;
  int sms = 0;
  cudaStream_t stream = nullptr;
  ncclComm_t comm = nullptr;
  std::vector<DeviceMem> keep;  // weights and small tensors
  DevW embed, head, hc_head_fn;
  const float *norm = nullptr, *hc_head_base = nullptr, *hc_head_scale = nullptr;
  const float *inv_main = nullptr, *inv_compress = nullptr;
  std::vector<LayerDev> layers;
  DeviceMem fixed, pages, table, scratch_mem;
  // DSpark drafter (tp == 1): stages as sliding layers (st.ring_off = the stage's ring in the slot), the
  // feature projection, the last stage's head and the Markov head; scratch for its per-row tensors.
  std::vector<LayerDev> stages;
  DevW main_proj, d_hc_head_fn, markov_w1, markov_w2;
  const float *main_norm = nullptr, *d_norm = nullptr, *d_hc_head_base = nullptr, *d_hc_head_scale = nullptr;
  float *features = nullptr, *main_x = nullptr, *h_pre = nullptr, *mrows = nullptr;  // [NR, T·D] [NR, D] [NR, D] [LR, r]
  int32_t* mids = nullptr;                                                               // [LR]
  DeviceMem drafter_mem;
  // CudaOptions::drafter_experts = "gpu": each stage's routed experts (views into dx_weights) and the scratch.
  std::vector<Mxfp4Experts> dx;
  DeviceMem dx_weights, dx_scratch;
  Mxfp4Scratch dx_sc;
  // Speculative steps: snap = a copy of each slot's fixed state from before its last speculative step
  // [max_sequences, slot_bytes]; spec_log = that step's inputs [max_sequences, spec_slot_bytes] (LayerState).
  DeviceMem snap, spec_log;
  Scratch sc;
  std::vector<cudaEvent_t> ev_begin, ev_end;
  cudaEvent_t ev_hop = nullptr;  // a layer's MoE rows reached the host (RunSegment; the lane's)
  int64_t weight_bytes = 0;  // read per decode step
  ~Rank();
};

}  // namespace numoe::cuda

namespace numoe::cuda {

// One lane's step resources (CudaOptions::lanes): what a caller's step writes outside the sequences' state.
// The active lane's live in ranks_[0] (stream, sc, scratch_mem, events) and CudaModel's staging members and
// graph cache; its Lane is then empty. UseLane swaps them.
struct Lane {
  bool ready = false;  // allocated (lane 0 at Setup, the others on their first step)
  // Its stream runs at the least priority (its steps make way: ExpertBackend::background), else at the
  // greatest. Not swapped by SwapLane: it says which the lane's stream is, wherever it is held.
  bool background = false;
  cudaStream_t stream = nullptr;
  Scratch sc;
  DeviceMem scratch_mem;
  std::vector<cudaEvent_t> ev_begin, ev_end;
  cudaEvent_t ev_hop = nullptr;
  PinnedMem meta_h, y_h, routed_h, ids_h, wts_h, logits_h, greedy_h;
  std::map<std::pair<int64_t, bool>, std::vector<cudaGraphExec_t>> graphs;
};

// Sizes of one device pass (either the real ones, or capacity-based ones for a CUDA graph).
struct PassDims {
  int64_t n = 0;            // rows
  int64_t num_seqs = 0;
  int max_windows_csa = 0;  // windows closing per sequence in this pass (emission grid)
  int max_windows_hca = 0;
  int64_t max_vis = 0;      // indexer entries visible to the furthest row (score grid)
  int64_t logit_rows = 0;   // rows whose logits are needed
  bool greedy = false;      // argmax on the device instead of copying logits
  bool spec = false;        // some rows belong to speculative steps: log their cache inputs (never a graph)
  bool draft = false;       // a DSpark draft pass: bidirectional block attention, no cache writes
  // GPU prefill: the main layers' routed experts run on the device from the attached host experts (CudaModel::
  // prefill_), streamed in layer by layer, instead of the ExpertBackend (never a graph).
  bool host_experts = false;
};

class CudaModel final : public CudaBackend {
 public:
  // ckpt == nullptr: synthetic weights for `cfg` (benchmarks).
  static StatusOr<std::unique_ptr<CudaModel>> Create(const Checkpoint* ckpt, const ModelConfig& cfg,
                                                     const CudaOptions& opt, uint64_t seed);
  ~CudaModel() override;

  StatusOr<SequenceId> CreateSequence() override;
  Status ReleaseSequence(SequenceId seq) override;
  Status Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                 std::vector<SequenceLogits>* out) override;
  StatusOr<SequenceMemory> Memory(SequenceId seq) const override;
  // A speculative step copies each of its sequences' fixed state (slot) aside and logs the step's window keys
  // and compressor projections. Rollback restores the copy and replays the window and compressor updates of
  // the kept tokens from the log (the same kernels on the same inputs), so the state is what a step of only
  // the kept tokens would have left; compressed entries past the new position are simply no longer counted.
  // The device work is deferred to the next Forward/Draft, which does every pending rollback in one batch.
  Status Rollback(SequenceId seq, int64_t num_tokens) override;
  Status Settle(SequenceId seq) override;
  // A new slot and pages holding copies of the parent's (device-to-device, on every rank).
  StatusOr<SequenceId> ForkSequence(SequenceId parent) override;
  // To pinned host memory (cudaHostAlloc) and back, on every rank: a host page of m·page_tokens_ positions
  // is the m device pages of those positions (rank by rank); the rest is the slot's fixed state and the
  // device pages past the last whole host page (rank by rank). export_align is page_tokens_.
  StatusOr<HostState> ExportSequence(SequenceId seq, int64_t page_tokens, int64_t first_page) override;
  StatusOr<SequenceId> ImportSequence(const HostState& state) override;
  int64_t vocab_size() const override { return cfg_.vocab_size; }
  // Speculative steps need CudaOptions::max_spec_tokens > 0 (the snapshot and log are sized by it).
  // Lanes (CudaOptions::lanes; tp == 1, no drafter): steps of callers on different lanes interleave at
  // their ExpertBackend calls.
  Capabilities capabilities() const override {
    const bool lanes = lanes_.size() > 1;
    return Capabilities{.verify = spec_tokens_ > 0,
                        .drafter = stages_ > 0 ? SpecMethod::kDspark : SpecMethod::kNone,
                        .max_spec_tokens = spec_tokens_,
                        .interleaved_steps = lanes,
                        .lanes = lanes ? static_cast<int64_t>(lanes_.size()) : 0,
                        .fork = true,
                        .export_align = page_tokens_};
  }
  Status Draft(std::span<const DraftRequest> requests, ExpertBackend* experts,
               std::vector<DraftResult>* out) override;

  Status ForwardGreedy(std::span<const SequenceStep> steps, ExpertBackend* experts,
                       std::vector<int32_t>* tokens) override;
  void set_collect_stats(bool on) override { collect_stats_ = on; }
  CudaStepStats last_stats() const override { return stats_; }
  int64_t weight_bytes_per_step() const override;
  Status FillRandomContext(SequenceId seq, int64_t position, uint64_t seed) override;
  std::string Describe() const override;
  int64_t drafter_expert_bytes() const override;
  void set_hidden_hook(HiddenHook hook) override { hidden_hook_ = std::move(hook); }
  // GPU prefill (cuda_prefill.cc): pins the regions (cudaHostRegister, read-only where the device supports it),
  // allocates the layer double buffer and PackedMoe's scratch on rank 0's GPU once (sized for the largest
  // layer attached and rows_cap_ rows), and times a one-layer upload.
  StatusOr<HostExpertsAttachment> AttachHostExperts(const HostExperts* experts) override;
  void DetachHostExperts(const HostExperts* experts) override;

 private:
  struct Seq {
    int32_t slot = 0;
    int64_t position = 0;
    std::vector<int32_t> pages;
    // The last step was speculative: it began at spec_start (the slot copy's position); Rollback may go
    // back to any position in [spec_start, position].
    bool spec = false;
    int64_t spec_start = 0;
    bool replay = false;  // rolled back: restore + replay pending (FlushRollbacks)
  };
  // One sequence's share of a device pass.
  struct PassSeq {
    Seq* seq;
    int64_t id;         // its SequenceId (MoeRequest::seqs)
    size_t step;        // index into the caller's steps
    const int32_t* tokens;
    int64_t count;
    bool logits_all;    // logits for every row of this chunk
    bool logits_last;   // logits for the last row (the step's last token)
    int64_t offset;     // index of the first token within the step
    bool spec;          // the step is speculative: log its rows
  };

  CudaModel(const ModelConfig& cfg, const CudaOptions& opt);
  Status Setup(const Checkpoint* ckpt, uint64_t seed);
  Status SetupRank(Rank& r, const WeightSource& src, uint64_t seed);
  Status SetupLayer(Rank& r, const WeightSource& src, int64_t l, uint64_t seed);
  Status SetupState(Rank& r);
  // The active lane's step resources: activation scratch + segment events on `r`, pinned host staging.
  Status AllocScratch(Rank& r);
  Status AllocStaging();
  // Makes `lane` the active one (allocating its resources on first use); every call that enqueues device
  // work or uses the staging runs on the active lane, so Forward/Draft re-activate theirs after each
  // ExpertBackend call (another lane's step may have run meanwhile).
  // Makes `lane` the active one (its stream at the least priority when `background`, lanes 1.. only).
  Status UseLane(int lane, bool background = false);
  Status SwitchLane(int lane);  // UseLane's swap (and the lane's first allocation)
  void SwapLane(Lane& l);
  void ComputeLayout();
  int64_t PagesFor(int64_t position) const;

  Status ValidateSteps(std::span<const SequenceStep> steps, std::vector<Seq*>* seqs) const;
  Status EnsurePages(const std::vector<Seq*>& seqs, const std::vector<int64_t>& new_positions);
  Status RunSteps(std::span<const SequenceStep> steps, ExpertBackend* experts, std::vector<SequenceLogits>* out,
                  std::vector<int32_t>* greedy);
  Status RunPass(const std::vector<PassSeq>& pass, ExpertBackend* experts, bool greedy,
                 std::vector<SequenceLogits>* out, std::vector<int32_t>* tokens);

  template <typename T>
  void EnqueueSegment(Rank& r, int seg, const PassDims& d);
  // post_y (+ post_y2 when set): the previous layer's FFN output whose mHC post (PhaseFfnPost) is still to be
  // applied to sc.X: it is applied here, fused with the mixing projection where HcPostMixFits (nullptr: sc.X
  // is up to date).
  template <typename T>
  void PhaseAttention(Rank& r, int l, const PassDims& d, float* post_y = nullptr,
                      const float* post_y2 = nullptr);
  void PhaseFfnPre(Rank& r, int l, const PassDims& d);
  void PhaseSharedAndRouted(Rank& r, int l, const PassDims& d);  // PhaseShared + PhaseAddRouted
  void PhaseShared(Rank& r, int l, const PassDims& d);            // the shared expert into sc.sh
  // sc.sh += the routed experts' sum (rank 0). add == false: only brings sc.routed to the device (where the
  // host computed it) and returns it, for the fused mHC post to add; else returns nullptr.
  const float* PhaseAddRouted(Rank& r, int l, const PassDims& d, bool add = true);
  // What runs on the GPU after segment `seg` hands its MoE rows to the host (RunSegment records ev_hop
  // before it): the shared expert of layer seg, overlapping the worker's routed experts.
  void EnqueueTail(Rank& r, int seg, const PassDims& d);
  void PhaseFfnPost(Rank& r, const PassDims& d);
  void PhaseHead(Rank& r, const PassDims& d, int64_t row0, int64_t rows);
  Status AllReduce(float* Scratch::*buf, int64_t count);
  Status RunSegment(int seg, const PassDims& d, bool use_graph);
  Status CheckLaunches();
  void EmitHidden(Rank& r, int64_t layer, const PassDims& d);

  // Runs the pending rollbacks' device work (before anything else reads or writes a sequence's state).
  // Runs the pending rollbacks (restore + replay) of every sequence, or only of `only` when given.
  Status FlushRollbacks(const Seq* only = nullptr);
  template <typename T>
  Status EnqueueReplay(Rank& r, const std::vector<Seq*>& pending);
  // DSpark: layers l >= num_hidden_layers are the drafter's stages.
  const LayerDev& LayerOf(const Rank& r, int l) const {
    const int L = static_cast<int>(cfg_.num_hidden_layers);
    return l < L ? r.layers[static_cast<size_t>(l)] : r.stages[static_cast<size_t>(l - L)];
  }
  Status SetupDrafter(Rank& r, const WeightSource& src, uint64_t seed);
  Status SetupDrafterExperts(Rank& r, const Checkpoint& ck);
  // The stage l (>= num_hidden_layers) computes its routed experts on the device.
  bool GpuStageExperts(int l) const { return gpu_dx_ && l >= cfg_.num_hidden_layers; }
  template <typename T>
  void PhaseDrafterFeed(Rank& r, const PassDims& d);
  template <typename T>
  Status RunDraft(std::span<const DraftRequest> requests, ExpertBackend* experts, std::vector<DraftResult>* out);
  CompArgs MainCompArgs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const;
  CompArgs IndexCompArgs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const;
  CompJobs LayerCompJobs(const Rank& r, const LayerDev& L, const float* comp, int64_t ld) const;

  // GPU prefill (cuda_prefill.cc). A pass with host_experts uploads layer l into buffer l % 2 on
  // prefill_stream_ (waiting until the layer two before it is done with the buffer: prefill_free_) and computes
  // layer l's experts on the rank's stream once the upload is in (prefill_ready_); layer l + 1 uploads while
  // layer l computes. No host round trip in the pass.
  bool UseHostExperts(const ExpertBackend* experts, int64_t rows) const;
  Status BeginHostExpertPass(const HostExperts* experts);
  void UploadHostLayer(int l);
  void EnqueueHostExpertLayer(Rank& r, int l, const PassDims& d);  // sc.routed of layer l (rank 0)
  void ReleaseHostExperts();                                       // the destructor's part

  StepDev StepOf(const Rank& r, const PassDims& d) const;
  CacheDev CacheOf(const Rank& r) const;
  void Gemm(Rank& r, const DevW& w, const float* x, int64_t ldx, int64_t n, float* y, int64_t ldy,
            bool tensor_cores = true);
  // The mHC pre step on the residual streams sc.X [n, hc, D] (docs §2.3): each row's inverse RMS, the mixing
  // projection `fn` (fp32), then HcPre. A block's (head == false) writes sc.xn (RMS-normed by `norm_w`),
  // sc.post and sc.comb; the head collapse (head == true) writes sc.xn and, when u_out is given, the
  // collapsed rows before the norm. post_y (head == false): first apply HcPost with post_y (+ post_y2 when set)
  // and sc.post/sc.comb to sc.X (fused with the mixing projection where HcPostMixFits).
  void HcPreStep(Rank& r, int64_t n, const DevW& fn, const float* base, const float* scale, const float* norm_w,
                 bool head, float* u_out = nullptr, float* post_y = nullptr, const float* post_y2 = nullptr);

  ModelConfig cfg_;
  CudaOptions opt_;
  bool bf16_cache_ = true;
  std::vector<std::unique_ptr<Rank>> ranks_;
  // Layout (identical on every rank).
  int64_t hc_ = 4, D_ = 0, hd_ = 0, Hl_ = 0, Gl_ = 0, Il_ = 0, max_context_ = 0;
  int64_t page_tokens_ = 0, page_elems_ = 0, max_pages_ = 0, num_pages_ = 0, slot_bytes_ = 0;
  int64_t fixed_bytes_per_seq_ = 0;
  int64_t rows_cap_ = 0, logit_rows_cap_ = 0;
  int64_t spec_tokens_ = 0, spec_slot_bytes_ = 0;  // CudaOptions::max_spec_tokens; log bytes per slot
  // DSpark (0 stages = none): the stages' state/log offsets, target layers, noise token, Markov rank.
  int64_t stages_ = 0, markov_rank_ = 0;
  std::vector<LayerState> stage_layout_;
  std::vector<int64_t> target_layers_;
  int32_t noise_token_ = 0;
  bool gpu_dx_ = false;  // the stages' routed experts are on the device (SetupDrafterExperts)
  std::vector<float> confidence_;  // host [D + markov rank]
  std::vector<LayerState> layout_;
  // Sequences.
  std::map<SequenceId, Seq> seqs_;
  std::vector<int32_t> free_slots_, free_pages_;
  SequenceId next_id_ = 1;
  // Host staging (pinned).
  PinnedMem meta_h_, y_h_, ids_h_, wts_h_, routed_h_, logits_h_, greedy_h_, table_h_;
  // CUDA graphs of decode passes: key (rows, greedy) -> one executable per segment.
  std::map<std::pair<int64_t, bool>, std::vector<cudaGraphExec_t>> graphs_;
  std::vector<Lane> lanes_;  // [1 + CudaOptions::lanes] with lanes, else [1]
  int active_lane_ = 0;
  bool graphs_broken_ = false;
  bool collect_stats_ = false;
  HiddenHook hidden_hook_;
  CudaStepStats stats_;
  // GPU prefill: the attached host experts with the region pointers registered for each; on rank 0's GPU the
  // double buffer of one layer (prefill_layer_bytes_ each), PackedMoe's scratch, the copy stream and its events;
  // the pass in progress's experts and the first PackedMoe error it met.
  std::map<const HostExperts*, std::vector<void*>> host_experts_;
  DeviceMem prefill_layer_[2], prefill_scratch_;
  int64_t prefill_layer_bytes_ = 0;
  cudaStream_t prefill_stream_ = nullptr;
  cudaEvent_t prefill_ready_[2] = {nullptr, nullptr}, prefill_free_[2] = {nullptr, nullptr};
  const HostExperts* prefill_ = nullptr;
  cudaError_t prefill_error_ = cudaSuccess;
  // A GPU-prefill pass is between BeginHostExpertPass and its end: it may have yielded the model between
  // layers (ExpertBackend::YieldModel), and the pass that runs meanwhile computes its experts the usual way.
  bool host_pass_active_ = false;
};

}  // namespace numoe::cuda
