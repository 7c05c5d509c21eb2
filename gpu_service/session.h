// One registered worker inside numoe-gpu: its channel, the thread that serves its steps, and its
// sequences (model state + sampler), keyed by the worker's own sequence keys, so the service-wide key
// is (lease, key).
//
// The serving thread loops: receive a StepRequest, make the forks it lists, release what it lists, create
// the sequences it opens,
// run the model's Forward for the whole step (the MoE of every layer going back to the worker over the
// channel), sample, answer with the StepResult, or with an Error that names the bad field.
// The step itself (drafts, the one Forward, verification, rollback, sampling) is RunModelStep
// (model/step.h); the session checks the wire, turns entries into step items and copies the output
// into the channel. It exits when
// the worker's process dies or closes the channel, or on Stop(); the owner then frees the session.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/shm_channel.h"
#include "model/backend.h"
#include "model/prefix_cache.h"
#include "model/prefix_step.h"
#include "model/sampling.h"
#include "model/step.h"
#include "gpu_service/expert_arena.h"
#include "gpu_service/fifo_mutex.h"
#include "gpu_service/latency.h"
#include "gpu_service/merged_step.h"
#include "gpu_service/shm_experts.h"

namespace numoe::gpu {

// The model shared by every worker session.
struct ModelHost {
  ModelBackend* model = nullptr;
  // The prefix cache every session shares (model/prefix_cache.h; null with --no-prefix-cache): a prompt
  // one worker's request left in it serves another worker's request. Used under forward_mu.
  PrefixCache* prefix_cache = nullptr;
  // One thread computes on the model at a time; sessions take turns in arrival order. With
  // `interleaved_steps` (the backend's Capabilities) a session gives the model up while its worker computes
  // a layer's experts, so another worker's step runs meanwhile (lanes, layer by layer); otherwise a step
  // holds it from start to end.
  FifoMutex forward_mu;
  bool interleaved_steps = false;
  // Capabilities::lanes: 0 = every session interleaves; N > 0 = sessions holding one of lanes 1..N-1
  // interleave, the others share lane 0 and hold the model for whole steps.
  int64_t lanes = 0;
  // Takes a free lane in 1..lanes-1 (0 when none is free or the backend has no lanes); ReleaseLane gives it back.
  int AcquireLane();
  void ReleaseLane(int lane);
  std::mutex lanes_mu;
  std::vector<bool> lane_taken;  // [lanes]
  // Compiled grammars of constrained sequences over the model's tokenizer (null: the model directory has no
  // tokenizer.json, and a constrained sequence is refused).
  std::unique_ptr<tokenizer::GrammarCache> grammars;
  LatencyRecorder hops;
  std::atomic<uint64_t> steps{0};
  std::atomic<uint64_t> tokens{0};
  // Steps between their start and end (a yielded one included), and the steps that started while another
  // was in progress (interleaved at its expert calls).
  std::atomic<int64_t> steps_in_progress{0};
  std::atomic<uint64_t> overlapped_steps{0};
  // Speculative decoding: verify steps (entries with drafts), drafts verified, drafts accepted.
  std::atomic<uint64_t> spec_steps{0};
  std::atomic<uint64_t> spec_drafted{0};
  std::atomic<uint64_t> spec_accepted{0};
  // Merged passes (--merge-lanes, gpu_service/merged_step.h): decode sessions whose steps wait for the
  // model at the same time run them as one step. merged_steps counts the session steps that ran in a pass
  // with others, merged_passes those passes.
  bool merge = false;
  size_t merge_max_parts = 64;
  MergeQueue merge_queue;
  std::atomic<uint64_t> merged_steps{0};
  std::atomic<uint64_t> merged_passes{0};
};

// The sequences (model state + sampler) behind one or more sessions of one worker, by the worker's keys. A
// session has a table of its own, or shares the one of an earlier session of the same worker
// (RegisterRequest::share_sequences_with: the worker's prefill lane and decode lanes), so that a sequence
// one session prefilled is decoded by another without moving its state. A step claims its sequences
// (`stepping`) from its start to its end: another session's step, fork or release naming a claimed sequence
// is refused, so two lanes never touch one sequence at once. The table frees whatever it still holds when
// its last session lets it go (a worker that is gone frees its state however many lanes it had).
struct SequenceTable {
  struct Seq {
    CachedSequence state;  // the model sequence (model/prefix_step.h: probing while its prompt may be cached)
    Sampler sampler;
    const void* stepping = nullptr;  // the session whose step holds it now
  };
  explicit SequenceTable(ModelHost* h) : host(h) {}
  ~SequenceTable();  // releases every sequence left (under host->forward_mu)
  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;
  // Releases every sequence (the caller holds host->forward_mu and no step runs).
  void ReleaseAllLocked();

  ModelHost* host;
  std::mutex mu;  // guards the map and the claims; taken after host->forward_mu when both are held
  std::map<int64_t, Seq> seqs;
  std::atomic<int64_t> size{0};
  std::atomic<int> live{0};  // sessions holding it that have not stopped (the last one to stop frees the rest)
};

struct SessionInfo {
  uint64_t lease = 0;
  std::string worker_id;
  uint32_t pid = 0;
  bool background = false;  // a worker's prefill lane (RegisterRequest::prefill_lane): its steps make way
};

class WorkerSession {
 public:
  // `table`: the sequences this session shares with earlier sessions of its worker (null: a table of its own).
  WorkerSession(ModelHost* host, SessionInfo info, std::unique_ptr<shm::Channel> channel,
                std::shared_ptr<SequenceTable> table = nullptr);
  ~WorkerSession();  // Stop()
  WorkerSession(const WorkerSession&) = delete;
  WorkerSession& operator=(const WorkerSession&) = delete;

  // GPU prefill, before Start: the worker's expert arena as mapped here, the --gpu-prefill-threshold
  // (-1 = calibrate from the measured upload bandwidth and `row_seconds`, the worker's expert time per row and
  // layer; N > 0 = N rows), attached to the model when the serving thread starts (under forward_mu: pinning
  // the arena for DMA takes a while). Any failure there turns GPU prefill off for this worker, logged.
  void SetExpertArena(std::unique_ptr<MappedExpertArena> arena, int64_t threshold, double row_seconds);
  // Starts the serving thread; `on_exit` runs on it when it ends by itself (worker gone).
  void Start(std::function<void(uint64_t lease)> on_exit);
  // Ends the conversation (the worker sees the channel closed), joins the thread, frees every sequence.
  void Stop();

  const SessionInfo& info() const { return info_; }
  shm::Channel* channel() const { return channel_.get(); }
  // The sequences of its table, counted by the session that created the table (0 for one that shares it,
  // so a sum over sessions counts each sequence once).
  int64_t sequences() const { return owns_table_ ? table_->size.load() : 0; }
  const std::shared_ptr<SequenceTable>& table() const { return table_; }
  uint64_t steps() const { return steps_.load(); }
  uint64_t tokens() const { return tokens_.load(); }
  bool ended() const { return ended_.load(); }
  // Why the serving thread ended (OK while it runs).
  Status end_status() const;

  // Heartbeats (steady-clock milliseconds of the last one).
  void Touch();
  int64_t last_heartbeat_ms() const { return last_heartbeat_ms_.load(); }

 private:
  using Seq = SequenceTable::Seq;
  void Serve();
  void AttachExpertArena();
  void DetachExpertArena();
  Status HandleStep();
  // The step's sequences claimed (opened where new) into states_ / samplers_ (the caller holds forward_mu);
  // UnclaimAll gives them back.
  Status ClaimLocked();
  void UnclaimAll();
  // The validated step through the merge queue: run with the others waiting (this session's step first)
  // or by the session whose pass took it.
  Status MergedStep(int64_t n, int64_t rows);
  // out_ / cached_ into the channel's StepResult, and the step counters.
  void WriteOutputs(int64_t n, int64_t rows);
  void ReleaseAll();
  // The prefix cache's figures into a StepResult header.
  void ReportCache(shm::MsgHeader* out) const;

  ModelHost* host_;
  SessionInfo info_;
  std::unique_ptr<shm::Channel> channel_;
  int lane_ = 0;  // ModelHost::AcquireLane, before experts_
  ShmExpertBackend experts_;
  std::unique_ptr<MappedExpertArena> arena_;  // GPU prefill (SetExpertArena); attached while arena_attached_
  bool arena_attached_ = false;
  int64_t prefill_threshold_ = 0;
  double row_seconds_ = 0;
  std::shared_ptr<SequenceTable> table_;  // the session's sequences (shared with its worker's other lanes)
  bool owns_table_ = true;
  std::atomic<uint64_t> steps_{0}, tokens_{0};
  std::atomic<int64_t> last_heartbeat_ms_{0};
  std::atomic<bool> ended_{false};
  std::atomic<bool> stopping_{false};
  mutable std::mutex status_mu_;
  Status end_status_;
  std::function<void(uint64_t)> on_exit_;
  std::thread thread_;
  // Step scratch (serving thread).
  std::vector<shm::StepEntry> entries_;
  std::vector<int32_t> tokens_buf_;
  std::vector<shm::WireBias> biases_;
  std::vector<SamplingParams> open_params_;  // per entry: the sampling of an opening entry
  std::vector<std::shared_ptr<const tokenizer::Grammar>> open_grammars_;  // per entry: its compiled grammar
  std::string grammar_buf_;
  std::vector<StepItem> items_;       // the entries as step items (model SequenceIds once opened)
  std::vector<Sampler*> samplers_;
  std::vector<CachedSequence*> states_;
  std::vector<int32_t> cached_;
  StepScratch scratch_;
  StepOutput out_;
  std::vector<Seq*> claimed_;  // ClaimLocked
  StepOutput merged_out_;      // a merged pass this session ran
  std::vector<int32_t> merged_cached_;
};

int64_t SteadyMillis();

}  // namespace numoe::gpu
