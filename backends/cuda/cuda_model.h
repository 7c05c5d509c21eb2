// The CUDA backend of numoe-gpu: the non-expert DeepSeek-V4 model on one or more GPUs (tensor parallel
// over NCCL), with the routed experts on the CPU worker through an ExpertBackend called at every layer.
//
// This header has no CUDA includes: callers compile and link whether or not numoe was built with CUDA
// (NUMOE_CUDA). Without CUDA, or without a device, the factories return Unavailable.
//
// Numerics (docs/dsv4-architecture.md §2; the CPU backend in backends/cpu/ is the reference):
//   fp32 = true   fp32 activations and caches; dense weights kept exactly as stored (FP8 blocks, BF16, F32),
//                 fp32 SIMT GEMMs. Matches the transformers goldens within 1e-3 (measured ~5e-6).
//   fp32 = false  ("bf16 mode", the default) bf16 tensor-core GEMMs with fp32 accumulation (activations
//                 split into bf16 hi + lo unless split_activations = false); norms, softmaxes, mHC, router and
//                 indexer scores in fp32. Greedy tokens equal the goldens, logits within 5e-2.
//   bf16_cache    (bf16 mode only) stores the window ring, compressed entries and indexer keys in bf16: half
//                 the cache memory and cache reads, but the ~2^-9 rounding moves indexer scores enough to flip
//                 top-k picks that win by less than ~1e-3 (it does on the tiny fixture), so logits then drift
//                 from an fp32 reference by more than 5e-2. Off by default.
// Dense FP8-block weights stay FP8 on the device (weight-only GEMM: decode reads half the bytes of BF16)
// unless fp8_weights = false, which dequantizes them to BF16 at load.
//
// Tensor parallelism (tp = N, GPUs device .. device+N-1, one process): attention heads, the output
// projection's groups and the shared expert's width are split; the attention output and the MoE output are
// all-reduced. Everything else (mHC, compressors, indexer, router, head) is replicated on every rank, and so
// are the per-sequence caches.
//
// Capacity: every device allocation happens in Create (weights, `max_sequences` fixed-state slots, the page
// pool of compressed entries, scratch for `max_step_tokens` rows). A step that needs more than that fails with
// ResourceExhausted naming the limit and leaves every sequence unchanged; it never runs out of device memory.
//
// Speculative decoding: SequenceStep::speculative + Rollback (any depth up to max_spec_tokens - 1, any batch;
// Settle makes it final at once, so the prefix cache can checkpoint the sequence)
// and, for checkpoints with DSpark stages (tp == 1), the DSpark drafter (drafter() == kDspark, Draft()), whose
// routed experts run on the worker or, with drafter_experts = "gpu", on the device.
// Speculative steps are never replayed as CUDA graphs; a rollback's device work runs batched at the start of
// the next Forward/Draft.
//
// Thread-safety: one call at a time (the caller serialises steps), like the CPU backend.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "common/config.h"
#include "common/status.h"
#include "model/backend.h"

namespace numoe {

struct CudaOptions {
  int device = 0;    // first GPU; rank r uses device + r (when `devices` is empty)
  std::vector<int> devices;  // the GPUs in rank order (size tp, distinct); empty = device .. device + tp - 1
  int tp = 1;        // tensor-parallel GPUs; must divide num_attention_heads, o_groups and moe_intermediate_size
  bool fp32 = false;        // see above
  bool fp8_weights = true;  // keep FP8-block weights in FP8 (else dequantize to BF16); ignored when not FP8
  // bf16 mode: tensor-core GEMMs take the fp32 activations as a bf16 hi + lo pair (two products, ~16 mantissa
  // bits) instead of one bf16 rounding. Decode is weight-bandwidth bound, so it only costs prefill compute.
  bool split_activations = true;
  bool bf16_cache = false;  // see above; ignored in fp32 mode
  int64_t max_sequences = 64;  // live sequences (CreateSequence fails with ResourceExhausted past this)
  // Tokens per sequence (prompt + generated); 0 = min(max_position_embeddings, 131072).
  int64_t max_context = 0;
  // Page pool for compressed entries (CSA/HCA/indexer), MiB per GPU; 0 = enough for every slot at
  // max_context, capped at half the free device memory after the weights.
  int64_t cache_mb = 0;
  // Rows per device pass. Larger steps are run as consecutive passes (same result as chunked prefill).
  int64_t max_step_tokens = 2048;
  // Replay decode steps (one token per sequence) as CUDA graphs, one per layer segment (tp == 1 only).
  bool graphs = true;
  // Tokens of one speculative step per sequence (the last sampled token + up to max_spec_tokens - 1 drafts;
  // 17 covers SpecConfig's depth limit of 16); 0 refuses speculative steps and allocates nothing for them.
  // Rollback needs, per slot: a copy of the fixed state taken before the step (as large as the state itself)
  // and the step's window keys and compressor projections (max_spec_tokens rows per layer), so that it can
  // restore the state and replay the kept tokens' cache updates. Speculative steps never use CUDA graphs.
  int64_t max_spec_tokens = 17;
  // Load the checkpoint's DSpark drafter (stages mtp.*, tp == 1 only) when it has one: drafter() == kDspark
  // and Draft() runs its dense parts here (its routed experts through the ExpertBackend, as layers
  // num_hidden_layers + stage). Every step then also feeds the stages' rings from the target features.
  bool drafter = true;
  // Where the DSpark stages' routed experts run: "worker" (the ExpertBackend, layer num_hidden_layers + stage,
  // like the main model's) or "gpu": their MXFP4 weights + E8M0 scales are copied to the device as stored
  // (stages x n_routed_experts x 3 x hidden x moe_intermediate_size / 2 bytes plus 1/16 of that in scales:
  // 3.3 GB per stage at V4-Flash width) and Draft computes the stage MoE there, with no host round trip.
  // Ignored when no drafter is loaded. Measured (numoe-bench cuda --draft-experts, one H200, V4-Flash width,
  // 3 stages, depth 5, worker = 16 AMX cores in-process): Draft 7.2 vs 15.8 ms at batch 1, 65 vs 101 ms at
  // batch 8, 214 vs 402 ms at batch 32, for 9.6 GiB of device memory.
  std::string drafter_experts = "worker";
  // Callers whose steps may interleave at their ExpertBackend calls (Capabilities::interleaved_steps), each on
  // its own lane 1..lanes (ExpertBackend::lane()): a stream, activation scratch, pinned staging and graphs,
  // allocated on a lane's first step (about as much as lane 0's, logged). Lane 0 is for callers that hold
  // the model for whole steps. tp == 1 and no DSpark drafter only (else there is only lane 0); 0 = none.
  int64_t lanes = 0;
};

// Timings of the last Forward (filled when CudaBackend::set_collect_stats(true)).
struct CudaStepStats {
  double wall_ms = 0;  // host wall time of the step, expert calls included
  double gpu_ms = 0;   // sum of the device-side spans between the per-layer expert exchanges (CUDA events)
  int64_t rows = 0;
};

// The CUDA ModelBackend plus what only a device backend offers.
class CudaBackend : public ModelBackend {
 public:
  // Like Forward, but picks the greedy token of each sequence's last row on the device (argmax; ties ->
  // lowest id) and copies only the ids back: tokens[i] belongs to steps[i].
  virtual Status ForwardGreedy(std::span<const SequenceStep> steps, ExpertBackend* experts,
                               std::vector<int32_t>* tokens) = 0;
  virtual void set_collect_stats(bool on) = 0;
  virtual CudaStepStats last_stats() const = 0;
  // Bytes of dense weights that one decode step reads (all ranks summed), for bandwidth floors.
  virtual int64_t weight_bytes_per_step() const = 0;
  // Benchmarks only: advances `seq` to `position` tokens with random cache contents (allocating its pages)
  // instead of running a prefill. The sequence must be new (position 0).
  virtual Status FillRandomContext(SequenceId seq, int64_t position, uint64_t seed) = 0;
  virtual std::string Describe() const = 0;  // devices, modes, memory
  // Device bytes held for the drafter's routed experts (CudaOptions::drafter_experts = "gpu": weights, scales
  // and their scratch); 0 otherwise.
  virtual int64_t drafter_expert_bytes() const = 0;
  // Debug/test hook, like CpuModel's: the residual streams [rows, hc, D] after the embedding (layer -1) and
  // after each layer. Setting it turns CUDA graphs off; with tp > 1 it is not called.
  using HiddenHook = std::function<void(int64_t layer, const std::vector<float>& x)>;
  virtual void set_hidden_hook(HiddenHook hook) = 0;
};

// Device-to-device copy bandwidth of `device` in GB/s, counting the bytes read plus the bytes written (the
// usual way copy bandwidth is quoted), best of `iters` copies of `bytes` bytes.
StatusOr<double> MeasureDeviceCopyGBps(int device, int64_t bytes, int iters);

// Host-to-device copy bandwidth of `device` in GB/s from pinned host memory (what GPU prefill's uploads from a
// registered expert arena run at), best of `iters` copies of `bytes` bytes.
StatusOr<double> MeasureHostToDeviceGBps(int device, int64_t bytes, int iters);

// numoe-bench cuda --packed-moe: the routed experts of a prefill step on the device (cuda::PackedMoe,
// backends/cuda/kernels.h) on `experts` random experts of [hidden, inter] in the packed layout, `rows` rows with
// k distinct uniformly random experts each. Per point: the best of `iters` timed calls (CUDA events) after one
// warm-up, and the useful flops (6 · rows · k · hidden · inter) per second.
struct PackedMoeBenchPoint {
  int64_t rows = 0;
  double ms = 0;
  double flops = 0;       // useful flop/s
  double mma_flops = 0;   // flop/s the tensor cores ran (twice the useful with the hi + lo activations)
  int64_t scratch_bytes = 0;
};
StatusOr<std::vector<PackedMoeBenchPoint>> BenchPackedMoe(int device, const std::vector<int64_t>& rows, int64_t k,
                                                          int64_t experts, int64_t hidden, int64_t inter,
                                                          bool split_activations, int iters);
// The bf16 mma.sync m16n8k16 peak of `device` (register-resident loop on every SM), flop/s.
StatusOr<double> MeasureMmaBf16PeakFlops(int device);

// Number of CUDA devices visible (0 without CUDA or without a driver).
int CudaDeviceCount();
// True when numoe was built with the CUDA backend.
bool CudaCompiledIn();

// Loads the dense (non-routed-expert) weights of `ckpt` onto the GPU(s). Unavailable when numoe was built
// without CUDA or no device is present; InvalidArgument for bad options (naming the field).
StatusOr<std::unique_ptr<CudaBackend>> CreateCudaBackend(const Checkpoint& ckpt, const CudaOptions& options);
StatusOr<std::unique_ptr<ModelBackend>> CreateCudaModel(const Checkpoint& ckpt, const CudaOptions& options);

// A model of `config`'s shapes with random weights generated directly in device memory (benchmarks: no
// checkpoint on disk). Matrices use the official formats (FP8 blocks for the dense projections, BF16 for
// compressors, gate, embedding and head) subject to options.fp8_weights.
StatusOr<std::unique_ptr<CudaBackend>> CreateSyntheticCudaBackend(const ModelConfig& config,
                                                                  const CudaOptions& options, uint64_t seed);

}  // namespace numoe
