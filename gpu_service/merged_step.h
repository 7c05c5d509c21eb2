// Merged passes: the steps of several worker sessions that wait for the model at the same time run as one
// backend step (RunCachedStep over all their items), so the dense weights are read once for all their
// rows. At each MoE layer MergedExperts splits the layer's rows by the session that owns their sequence
// (MoeRequest::seqs), posts each part to its own worker (ShmExpertBackend::Post: every worker computes at
// once), collects the answers and scatters them back. A worker that fails is dropped from the pass alone:
// its rows get zeros from then on and its session answers the step with the error; the others' rows are
// computed exactly as in a step of their own (the CPU backend is batch invariant).
//
// MergeQueue is how sessions meet: a session posts its validated step, takes the model (forward_mu) and
// either finds its step already taken into another session's merged pass (it waits for it to finish) or
// takes every step posted so far and runs them (its own first).
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <cstdint>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/choices.h"
#include "common/status.h"
#include "model/backend.h"
#include "model/prefix_step.h"
#include "model/step.h"
#include "gpu_service/fifo_mutex.h"
#include "gpu_service/shm_experts.h"

namespace numoe::gpu {

// --merge-lanes (common/choices.h MergeLanes): off = every session steps alone (lanes); on = sessions
// waiting at the same time merge; auto = where measured to pay (README "Merged passes"). Measured so far:
// slower on both backends (CPU tiny-v4 4 sim workers at 4 streams 74 vs 80 tok/s; H200 6-layer V4-Flash
// width, 4 sim 100 GB/s workers: 455 vs 602 tok/s at 8 streams, 652 vs 791 at 16), so auto is off for both:
// a merged pass serialises the GPU's layers and the workers' experts that separate lanes overlap.
bool MergeEnabled(MergeLanes m, bool cuda_backend);

// One session's part of a merged step: its expert channel and the sequences its items step.
struct MergePart {
  ShmExpertBackend* experts = nullptr;
  std::span<CachedSequence* const> states;  // model_seq looked up at each MoE call (restores may change it)
  Status status;                            // the part's first failure (its rows get zeros from then on)
};

// Row split of one MoE call: rows[p] are the call's rows owned by part p, in order.
struct RowSplit {
  std::vector<std::vector<int64_t>> rows;
};
// Splits `n` rows by owner: owner(seqs[r]) is the part of row r (< parts), or -1 (an error naming the row).
StatusOr<RowSplit> SplitRows(const int64_t* seqs, int64_t n, size_t parts,
                             const std::function<int(int64_t)>& owner);
// dst[i] = src[rows[i]] (rows of `width` elements), and back.
template <typename T>
void GatherRows(const T* src, int64_t width, std::span<const int64_t> rows, T* dst);
template <typename T>
void ScatterRows(const T* src, int64_t width, std::span<const int64_t> rows, T* dst);

// The ExpertBackend of a merged step. Not thread-safe: one step at a time.
class MergedExperts final : public ExpertBackend {
 public:
  // `parts` outlive it; `yield` (the model mutex the caller holds, null = keep it) is given up while the
  // workers compute; `lane` is the lane the merged step runs on (its first part's).
  MergedExperts(std::vector<MergePart>* parts, FifoMutex* yield, int lane) : parts_(parts), yield_(yield), lane_(lane) {}
  Status RunRouted(const MoeRequest& request) override;
  int lane() const override { return lane_; }

 private:
  std::vector<MergePart>* parts_;
  FifoMutex* yield_;
  int lane_;
  struct Buf {
    std::vector<float> x, w, out;
    std::vector<int32_t> ids;
    MoeRequest req;
    bool posted = false;
  };
  std::vector<Buf> bufs_;
};

// Part [begin, end) of the items of a merged step's output, as the output of a step of those items alone.
void SliceStepOutput(const StepOutput& all, std::span<const StepItem> items, size_t begin, size_t end,
                     StepOutput* part);

// A session's step waiting for the model (MergeQueue).
struct PendingStep {
  void* session = nullptr;  // the WorkerSession
  bool taken = false;       // in some session's merged pass (its runner fills it and sets done)
  bool done = false;
  Status status;
};

// Sessions that step one after the other never find each other waiting (their steps interleave, staggered),
// so a posted step first waits, without the model, for the other active sessions' steps (AwaitPeers): the
// sessions that posted a step within the last 4 step times and have none posted now, for one step time at
// most (the last merged or single step's wall time). Once they met, their steps end together and they stay
// in step; a session that stops stepping stops being waited for after 4 step times.
class MergeQueue {
 public:
  void Post(PendingStep* p);
  // Until every active session has a step posted, `p` is taken, or one step time passed.
  void AwaitPeers(PendingStep* p);
  // The wall time of a step just run (the bound of AwaitPeers).
  void RecordStep(double seconds);
  // A session gone: never waited for again.
  void Forget(const void* session);
  // Under the model mutex: every step posted and not taken yet, `self` first, at most `max_parts` (all
  // marked taken); empty when `self` was already taken by another runner.
  std::vector<PendingStep*> Take(PendingStep* self, size_t max_parts);
  void Finish(PendingStep* p, Status st);
  // Until Finish(p).
  void Wait(PendingStep* p);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<PendingStep*> posted_;
  std::map<const void*, std::chrono::steady_clock::time_point> last_post_;
  double step_s_ = 0;
};

}  // namespace numoe::gpu
