#include "gpu_service/session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>

#include "common/clock.h"
#include "common/log.h"
#include "gpu_service/merged_step.h"

namespace numoe::gpu {
namespace {

// A step holding the model, counted while it lives: ModelHost::steps_in_progress, and overlapped_steps when
// another step was already in progress.
class StepInProgress {
 public:
  explicit StepInProgress(ModelHost* host) : n_(&host->steps_in_progress) {
    if (n_->fetch_add(1) > 0) host->overlapped_steps.fetch_add(1);
  }
  ~StepInProgress() { n_->fetch_sub(1); }
  StepInProgress(const StepInProgress&) = delete;
  StepInProgress& operator=(const StepInProgress&) = delete;

 private:
  std::atomic<int64_t>* n_;
};

}  // namespace

int64_t SteadyMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int ModelHost::AcquireLane() {
  std::lock_guard<std::mutex> lk(lanes_mu);
  lane_taken.resize(static_cast<size_t>(std::max<int64_t>(lanes, 0)), false);
  for (size_t i = 1; i < lane_taken.size(); ++i) {
    if (!lane_taken[i]) {
      lane_taken[i] = true;
      return static_cast<int>(i);
    }
  }
  return 0;
}

void ModelHost::ReleaseLane(int lane) {
  std::lock_guard<std::mutex> lk(lanes_mu);
  if (lane > 0 && static_cast<size_t>(lane) < lane_taken.size()) lane_taken[static_cast<size_t>(lane)] = false;
}

SequenceTable::~SequenceTable() {
  if (seqs.empty()) return;
  std::lock_guard<FifoMutex> lk(host->forward_mu);
  ReleaseAllLocked();
}

void SequenceTable::ReleaseAllLocked() {
  std::lock_guard<std::mutex> lk(mu);
  for (auto& [key, s] : seqs) ReleaseCachedSequence(*host->model, host->prefix_cache, &s.state);
  seqs.clear();
  size.store(0);
}

WorkerSession::WorkerSession(ModelHost* host, SessionInfo info, std::unique_ptr<shm::Channel> channel,
                             std::shared_ptr<SequenceTable> table)
    : host_(host),
      info_(std::move(info)),
      channel_(std::move(channel)),
      lane_(host->AcquireLane()),
      experts_(channel_.get(), &host->hops, lane_, info_.background),
      table_(table),
      owns_table_(table == nullptr) {
  if (table_ == nullptr) table_ = std::make_shared<SequenceTable>(host);
  table_->live.fetch_add(1);
  Touch();
}

WorkerSession::~WorkerSession() {
  Stop();
  host_->ReleaseLane(lane_);
}

void WorkerSession::Touch() { last_heartbeat_ms_.store(SteadyMillis()); }

Status WorkerSession::end_status() const {
  std::lock_guard<std::mutex> lk(status_mu_);
  return end_status_;
}

void WorkerSession::SetExpertArena(std::unique_ptr<MappedExpertArena> arena, int64_t threshold, double row_seconds) {
  arena_ = std::move(arena);
  prefill_threshold_ = threshold;
  row_seconds_ = row_seconds;
}

void WorkerSession::AttachExpertArena() {
  if (arena_ == nullptr) return;
  const std::string who = absl::StrCat("worker ", info_.worker_id, " (lease ", info_.lease, ")");
  std::lock_guard<FifoMutex> lk(host_->forward_mu);
  auto att = host_->model->AttachHostExperts(arena_->host_experts());
  if (!att.ok() && absl::IsFailedPrecondition(att.status()) && !arena_->writable()) {
    // The device cannot register read-only host memory: map the arena writable (never written) and try again.
    NLOG(INFO) << "GPU prefill for " << who << ": " << att.status().message() << "; mapping the arena read-write";
    auto rw = arena_->Reopen(/*writable=*/true);
    if (rw.ok()) {
      arena_ = std::move(*rw);
      att = host_->model->AttachHostExperts(arena_->host_experts());
    } else {
      att = rw.status();
    }
  }
  if (!att.ok()) {
    NLOG(WARNING) << "GPU prefill off for " << who << ": " << att.status();
    arena_.reset();
    return;
  }
  arena_attached_ = true;
  HostExperts* he = arena_->host_experts();
  const int64_t calibrated = CalibratedPrefillRows(he->layer_bytes(), att->h2d_gbps, row_seconds_);
  he->min_rows = prefill_threshold_ > 0 ? prefill_threshold_ : calibrated;
  experts_.set_host_experts(he);
  NLOG(INFO) << "GPU prefill for " << who << ": registered " << arena_->spec().bytes << " bytes of experts for DMA in "
             << att->register_seconds << " s" << (arena_->writable() ? " (mapped read-write)" : " (read-only)")
             << "; host-to-device " << att->h2d_gbps << " GB/s, " << he->layer_bytes() << " bytes per layer ("
             << static_cast<double>(he->layer_bytes()) / (att->h2d_gbps * 1e9) * 1e3 << " ms to upload), worker experts "
             << row_seconds_ * 1e6 << " us per row per layer -> calibrated threshold " << calibrated << " rows; "
             << (prefill_threshold_ > 0 ? absl::StrCat("using --gpu-prefill-threshold ", prefill_threshold_)
                                        : absl::StrCat("using ", he->min_rows, he->min_rows == 0 ? " (off: a speed is unknown)" : ""))
             << "; " << att->device_bytes << " bytes of GPU memory (two layer buffers and scratch, shared by every worker)";
}

void WorkerSession::DetachExpertArena() {
  if (arena_ == nullptr) return;
  experts_.set_host_experts(nullptr);
  if (arena_attached_) {
    std::lock_guard<FifoMutex> lk(host_->forward_mu);
    host_->model->DetachHostExperts(arena_->host_experts());
    arena_attached_ = false;
  }
  arena_.reset();
}

void WorkerSession::Start(std::function<void(uint64_t)> on_exit) {
  on_exit_ = std::move(on_exit);
  thread_ = std::thread([this] { Serve(); });
}

void WorkerSession::Stop() {
  if (stopping_.exchange(true)) {
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
    return;
  }
  channel_->Interrupt();  // wakes the serving thread wherever it waits (idle or mid-step)
  channel_->Close();      // the worker's pending Receive fails: its step ends with UNAVAILABLE
  if (thread_.joinable()) thread_.join();
  host_->merge_queue.Forget(this);
  ReleaseAll();
  DetachExpertArena();
}

void WorkerSession::ReleaseAll() {
  // A table other running sessions hold stays theirs: the last one to stop frees what is left.
  if (table_->live.fetch_sub(1) != 1 || table_->size.load() == 0) return;
  std::lock_guard<FifoMutex> lk(host_->forward_mu);
  table_->ReleaseAllLocked();
}

void WorkerSession::Serve() {
  AttachExpertArena();
  Status why;
  for (;;) {
    auto type = channel_->Receive(-1);
    if (!type.ok()) {
      why = type.status();
      break;
    }
    Status st;
    if (*type != shm::MsgType::kStepRequest) {
      st = absl::FailedPreconditionError(
          absl::StrCat("protocol: expected a StepRequest, got ", shm::MsgTypeName(*type)));
    } else {
      st = HandleStep();
    }
    if (experts_.broken()) {  // the worker vanished mid-step
      why = experts_.broken_status();
      break;
    }
    Status sent = st.ok() ? channel_->Send(shm::MsgType::kStepResult) : channel_->SendError(st);
    if (!sent.ok()) {
      why = sent;
      break;
    }
  }
  {
    std::lock_guard<std::mutex> lk(status_mu_);
    end_status_ = why;
  }
  ended_.store(true);
  if (!stopping_.load()) {
    NLOG(INFO) << "worker " << info_.worker_id << " (lease " << info_.lease << ", pid " << info_.pid
               << ") is gone: " << why;
    if (on_exit_) on_exit_(info_.lease);
  }
}

void WorkerSession::ReportCache(shm::MsgHeader* out) const {
  if (host_->prefix_cache == nullptr) {
    out->prefix_cache_bytes = out->prefix_host_bytes = -1;
    out->prefix_queried_tokens = out->prefix_hit_tokens = 0;
    out->prefix_evicted = out->prefix_host_evicted = 0;
    return;
  }
  const PrefixCacheStats st = host_->prefix_cache->stats();
  out->prefix_cache_bytes = st.bytes;
  out->prefix_queried_tokens = static_cast<int64_t>(st.queried_tokens);
  out->prefix_hit_tokens = static_cast<int64_t>(st.hit_tokens);
  out->prefix_host_bytes = st.page_tokens > 0 ? st.host_bytes : -1;  // page_tokens 0: no host tier
  out->prefix_evicted = static_cast<int64_t>(st.evicted);
  out->prefix_host_evicted = static_cast<int64_t>(st.host_evicted);
}

Status WorkerSession::HandleStep() {
  // A copy: the header lives in memory the worker can write, so every count is checked and used from one read
  // (a hostile worker rewriting it between the check and the copy below must not move the copy's bounds).
  const shm::MsgHeader m = channel_->incoming();
  const shm::Geometry& g = channel_->geometry();
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("StepRequest: ", what)); };
  if (m.num_releases < 0 || m.num_releases > g.max_seqs) {
    return bad(absl::StrCat("num_releases ", m.num_releases, " outside [0, ", g.max_seqs, "]"));
  }
  if (m.num_entries < 0 || m.num_entries > g.max_seqs) {
    return bad(absl::StrCat("num_entries ", m.num_entries, " outside [0, ", g.max_seqs, "]"));
  }
  if (m.num_tokens < 0 || m.num_tokens > g.max_rows) {
    return bad(absl::StrCat("num_tokens ", m.num_tokens, " outside [0, ", g.max_rows, "]"));
  }
  if (m.num_forks < 0 || m.num_forks > g.max_seqs) {
    return bad(absl::StrCat("num_forks ", m.num_forks, " outside [0, ", g.max_seqs, "]"));
  }
  if (m.num_forks > 0 && g.fork == 0) return bad("forks, but this channel does not serve them (fork 0)");
  const int64_t max_biases = int64_t{g.max_seqs} * shm::kMaxWireBias;
  if (m.num_biases < 0 || m.num_biases > max_biases) {
    return bad(absl::StrCat("num_biases ", m.num_biases, " outside [0, ", max_biases, "]"));
  }
  // Copy what the model will read: the worker must not be able to change it under a running Forward.
  const int64_t n = m.num_entries;
  entries_.assign(channel_->entries(), channel_->entries() + n);
  tokens_buf_.assign(channel_->tokens(), channel_->tokens() + m.num_tokens);
  std::vector<int64_t> releases(channel_->releases(), channel_->releases() + m.num_releases);
  std::vector<shm::WireFork> forks(channel_->forks(), channel_->forks() + m.num_forks);
  biases_.assign(channel_->biases(), channel_->biases() + m.num_biases);
  if (m.num_grammar_bytes < 0 || m.num_grammar_bytes > shm::kMaxWireGrammarBytes) {
    return bad(absl::StrCat("num_grammar_bytes ", m.num_grammar_bytes, " outside [0, ", shm::kMaxWireGrammarBytes, "]"));
  }
  grammar_buf_.assign(channel_->grammars(), static_cast<size_t>(m.num_grammar_bytes));
  int64_t grammar_at = 0;
  const int64_t vocab = host_->model->vocab_size();
  // Sampling of a fork or an opening entry, its logit bias taken from `biases` in order.
  int64_t bias_at = 0;
  auto read_sampling = [&](const shm::WireSampling& w, const std::string& at) -> StatusOr<SamplingParams> {
    if (w.num_bias < 0 || w.num_bias > static_cast<int32_t>(shm::kMaxWireBias) || bias_at + w.num_bias > m.num_biases) {
      return bad(absl::StrCat(at, ": num_bias ", w.num_bias, " outside [0, ", shm::kMaxWireBias,
                              "] or past num_biases"));
    }
    if (w.grammar_bytes < 0 || grammar_at + w.grammar_bytes > m.num_grammar_bytes) {
      return bad(absl::StrCat(at, ": grammar_bytes ", w.grammar_bytes, " negative or past num_grammar_bytes"));
    }
    SamplingParams p = FromWireSampling(w, std::span<const shm::WireBias>(biases_.data() + bias_at,
                                                                           static_cast<size_t>(w.num_bias)),
                                        std::string_view(grammar_buf_).substr(static_cast<size_t>(grammar_at),
                                                                              static_cast<size_t>(w.grammar_bytes)));
    bias_at += w.num_bias;
    grammar_at += w.grammar_bytes;
    if (Status st = ValidateSampling(p, vocab); !st.ok()) return bad(absl::StrCat(at, ": sampling.", st.message()));
    return p;
  };

  // Forks first: each copies an open sequence's state before anything of this message changes it.
  if (!forks.empty()) {
    std::vector<SamplingParams> fork_params;
    std::set<int64_t> fresh;
    std::lock_guard<FifoMutex> lk(host_->forward_mu);
    std::lock_guard<std::mutex> tk(table_->mu);
    auto& seqs = table_->seqs;
    for (size_t i = 0; i < forks.size(); ++i) {
      const shm::WireFork& f = forks[i];
      const std::string at = absl::StrCat("forks[", i, "] (sequence ", f.seq, ")");
      if (seqs.count(f.seq) != 0 || !fresh.insert(f.seq).second) return bad(absl::StrCat(at, ": the key is in use"));
      auto parent = seqs.find(f.parent);
      if (parent == seqs.end()) return bad(absl::StrCat(at, ": unknown parent sequence ", f.parent));
      if (parent->second.stepping != nullptr) {
        return bad(absl::StrCat(at, ": parent sequence ", f.parent, " is in another lane's step"));
      }
      ASSIGN_OR_RETURN(SamplingParams p, read_sampling(f.sampling, at));
      if (!p.grammar.empty()) return bad(absl::StrCat(at, ": a fork carries no grammar (it follows its parent's)"));
      fork_params.push_back(std::move(p));
    }
    experts_.set_yield(nullptr);
    for (size_t i = 0; i < forks.size(); ++i) {
      Seq& parent = seqs.at(forks[i].parent);
      auto id = ForkCachedSequence(*host_->model, experts_, host_->prefix_cache, g.max_rows, &parent.state,
                                   &parent.sampler);
      if (!id.ok()) {
        return Status(id.status().code(), absl::StrCat("StepRequest: forks[", i, "]: ", id.status().message()));
      }
      Seq child{std::move(*id), Sampler(fork_params[i])};
      child.sampler.CopyHistoryFrom(parent.sampler);
      seqs.emplace(forks[i].seq, std::move(child));
    }
    table_->size.store(static_cast<int64_t>(seqs.size()));
  }

  // Releases first (unknown keys are ignored: a release may race with the session's own cleanup).
  if (!releases.empty()) {
    std::lock_guard<FifoMutex> lk(host_->forward_mu);
    std::lock_guard<std::mutex> tk(table_->mu);
    auto& seqs = table_->seqs;
    for (size_t i = 0; i < releases.size(); ++i) {  // nothing is released from a message that names a claimed one
      auto it = seqs.find(releases[i]);
      if (it != seqs.end() && it->second.stepping != nullptr) {
        return bad(absl::StrCat("releases[", i, "]: sequence ", releases[i], " is in another lane's step"));
      }
    }
    for (int64_t key : releases) {
      auto it = seqs.find(key);
      if (it == seqs.end()) continue;
      ReleaseCachedSequence(*host_->model, host_->prefix_cache, &it->second.state);
      seqs.erase(it);
    }
    table_->size.store(static_cast<int64_t>(seqs.size()));
  }
  shm::MsgHeader& out = channel_->outgoing();
  out.num_entries = 0;
  out.num_logits = 0;
  out.num_emitted = 0;
  out.num_logprobs = 0;
  ReportCache(&out);
  if (n == 0) return absl::OkStatus();

  // Validate every entry before touching the model: the wire (counts, flags, sequences, capacities) here,
  // the step rules by the one ValidateStepItem against what this channel declared.
  const Capabilities wire_caps = ChannelCapabilities(g);
  int64_t total = 0, rows = 0, logits_rows = 0;
  std::set<int64_t> seen;
  items_.resize(static_cast<size_t>(n));
  open_params_.assign(static_cast<size_t>(n), SamplingParams{});
  open_grammars_.assign(static_cast<size_t>(n), nullptr);
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    const std::string at = absl::StrCat("entries[", i, "] (sequence ", e.seq, ")");
    if (!seen.insert(e.seq).second) return bad(absl::StrCat(at, ": the sequence appears twice"));
    if (e.num_tokens < 1) return bad(absl::StrCat(at, ": num_tokens ", e.num_tokens, " < 1"));
    if (total + e.num_tokens > m.num_tokens) return bad(absl::StrCat(at, ": tokens run past num_tokens"));
    if ((e.flags & ~(shm::kEntryOpen | shm::kEntrySample | shm::kEntryLogits)) != 0) {
      return bad(absl::StrCat(at, ": unknown flags 0x", absl::Hex(e.flags)));
    }
    StepItem& item = items_[i];
    item = StepItem{.seq = e.seq,
                    .tokens = std::span<const int32_t>(tokens_buf_.data() + total, static_cast<size_t>(e.num_tokens)),
                    .sample = (e.flags & shm::kEntrySample) != 0,
                    .logits = (e.flags & shm::kEntryLogits) != 0,
                    .drafts = e.drafts,
                    .model_drafts = e.model_drafts};
    total += e.num_tokens;
    if (Status st = ValidateStepItem(item, wire_caps, vocab); !st.ok()) {
      return Status(st.code() == absl::StatusCode::kFailedPrecondition ? absl::StatusCode::kInvalidArgument : st.code(),
                    absl::StrCat("StepRequest: ", at, ": ", st.message()));
    }
    bool exists;
    {
      std::lock_guard<std::mutex> tk(table_->mu);
      exists = table_->seqs.count(e.seq) != 0;
    }
    if ((e.flags & shm::kEntryOpen) != 0) {
      if (exists) return bad(absl::StrCat(at, ": opened twice"));
      ASSIGN_OR_RETURN(open_params_[i], read_sampling(e.sampling, at));
      if (!open_params_[i].grammar.empty()) {
        if (host_->grammars == nullptr) {
          return bad(absl::StrCat(at, ": constrained output needs the model's tokenizer.json, which numoe-gpu did not find"));
        }
        auto g = host_->grammars->Get(open_params_[i].grammar);
        if (!g.ok()) return bad(absl::StrCat(at, ": sampling.", g.status().message()));
        open_grammars_[i] = *std::move(g);
      }
      if (item.speculative()) {
        return bad(absl::StrCat(at, ": drafts on the step that opens the sequence (nothing to verify against)"));
      }
    } else if (!exists) {
      return bad(absl::StrCat(at, ": unknown sequence (not opened, or already released)"));
    }
    if (item.logits && ++logits_rows > g.logits_rows) {
      return bad(absl::StrCat(at, ": more logits requested than the channel's logits_rows (", g.logits_rows, ")"));
    }
    rows += item.rows();
  }
  if (total != m.num_tokens) return bad(absl::StrCat("entries hold ", total, " tokens, num_tokens says ", m.num_tokens));
  if (grammar_at != m.num_grammar_bytes) {
    return bad(absl::StrCat("opening entries hold ", grammar_at, " grammar bytes, num_grammar_bytes says ",
                            m.num_grammar_bytes));
  }
  if (bias_at != m.num_biases) {
    return bad(absl::StrCat("forks and opening entries hold ", bias_at, " logit biases, num_biases says ", m.num_biases));
  }
  if (rows > g.max_rows) {
    return bad(absl::StrCat("num_tokens + model_drafts over the entries is ", rows, ", more than max_rows ", g.max_rows));
  }

  if (host_->merge && !info_.background) return MergedStep(n, rows);
  // A prefill lane's step takes the model after the decode steps waiting for it (FifoMutex::lock_background).
  if (info_.background) {
    host_->forward_mu.lock_background();
  } else {
    host_->forward_mu.lock();
  }
  std::lock_guard<FifoMutex> lk(host_->forward_mu, std::adopt_lock);
  const StepInProgress in_progress(host_);
  struct Unclaim {
    WorkerSession* s;
    ~Unclaim() { s->UnclaimAll(); }
  } unclaim{this};
  RETURN_IF_ERROR(ClaimLocked());
  // The model drafter's MoE goes over the channel as the stage layers num_hidden_layers + s. While the
  // worker computes a layer's experts, other sessions may use the model (ModelHost::interleaved_steps).
  // With lanes (the CUDA backend) only a session that holds a lane of its own interleaves.
  const bool interleave = host_->interleaved_steps && (host_->lanes == 0 || lane_ > 0);
  experts_.set_yield(interleave ? &host_->forward_mu : nullptr);
  RETURN_IF_ERROR(RunCachedStep(*host_->model, experts_, host_->prefix_cache, g.max_rows, items_, states_, samplers_,
                                &scratch_, &out_, &cached_));
  WriteOutputs(n, rows);
  return absl::OkStatus();
}

Status WorkerSession::ClaimLocked() {
  const int64_t n = static_cast<int64_t>(entries_.size());
  auto bad = [](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat("StepRequest: ", what)); };
  // Claim the step's sequences (opening the new ones) for its whole run; UnclaimAll gives them back.
  samplers_.resize(static_cast<size_t>(n));
  states_.resize(static_cast<size_t>(n));
  std::lock_guard<std::mutex> tk(table_->mu);
  auto& seqs = table_->seqs;
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    const std::string at = absl::StrCat("entries[", i, "] (sequence ", e.seq, ")");
    auto it = seqs.find(e.seq);
    if ((e.flags & shm::kEntryOpen) != 0) {
      if (it != seqs.end()) return bad(absl::StrCat(at, ": opened twice"));
      ASSIGN_OR_RETURN(CachedSequence state, OpenCachedSequence(*host_->model, host_->prefix_cache));
      it = seqs.emplace(e.seq, Seq{std::move(state), Sampler(open_params_[i], open_grammars_[i])}).first;
    } else if (it == seqs.end()) {
      return bad(absl::StrCat(at, ": unknown sequence (not opened, or already released)"));
    } else if (it->second.stepping != nullptr) {
      return bad(absl::StrCat(at, ": the sequence is in another lane's step"));
    }
    it->second.stepping = this;
    claimed_.push_back(&it->second);
    states_[i] = &it->second.state;
    samplers_[i] = &it->second.sampler;
  }
  table_->size.store(static_cast<int64_t>(seqs.size()));
  return absl::OkStatus();
}

void WorkerSession::UnclaimAll() {
  std::lock_guard<std::mutex> tk(table_->mu);
  for (Seq* s : claimed_) s->stepping = nullptr;
  claimed_.clear();
}

Status WorkerSession::MergedStep(int64_t n, int64_t rows) {
  PendingStep me{.session = this};
  host_->merge_queue.Post(&me);
  host_->merge_queue.AwaitPeers(&me);
  host_->forward_mu.lock();
  std::vector<PendingStep*> group = host_->merge_queue.Take(&me, host_->merge_max_parts);
  if (group.empty()) {  // another session's merged pass holds this step: it fills out_ and cached_
    host_->forward_mu.unlock();
    host_->merge_queue.Wait(&me);
    RETURN_IF_ERROR(me.status);
    WriteOutputs(n, rows);
    return absl::OkStatus();
  }
  std::lock_guard<FifoMutex> lk(host_->forward_mu, std::adopt_lock);
  const StepInProgress in_progress(host_);
  // Claim each part's sequences; a part whose claims fail answers with that error alone.
  std::vector<WorkerSession*> sessions;
  std::vector<PendingStep*> pending;
  for (PendingStep* p : group) {
    auto* s = static_cast<WorkerSession*>(p->session);
    if (Status st = s->ClaimLocked(); !st.ok()) {
      s->UnclaimAll();
      if (p == &me) {
        me.status = st;
      } else {
        host_->merge_queue.Finish(p, st);
      }
      continue;
    }
    sessions.push_back(s);
    pending.push_back(p);
  }
  Status own = me.status;
  if (!sessions.empty()) {
    // One step over every part's items, part after part.
    std::vector<StepItem> items;
    std::vector<CachedSequence*> states;
    std::vector<Sampler*> samplers;
    std::vector<size_t> begin;
    std::vector<MergePart> parts;
    int64_t max_rows = 0;
    for (WorkerSession* s : sessions) {
      begin.push_back(items.size());
      items.insert(items.end(), s->items_.begin(), s->items_.end());
      states.insert(states.end(), s->states_.begin(), s->states_.end());
      samplers.insert(samplers.end(), s->samplers_.begin(), s->samplers_.end());
      const int64_t mr = s->channel_->geometry().max_rows;
      max_rows = max_rows == 0 ? mr : std::min(max_rows, mr);
    }
    begin.push_back(items.size());
    for (size_t k = 0; k < sessions.size(); ++k) {
      parts.push_back(MergePart{.experts = &sessions[k]->experts_,
                                .states = std::span<CachedSequence* const>(states.data() + begin[k],
                                                                           begin[k + 1] - begin[k])});
    }
    const bool interleave = host_->interleaved_steps && (host_->lanes == 0 || lane_ > 0);
    MergedExperts experts(&parts, interleave ? &host_->forward_mu : nullptr, lane_);
    const int64_t t0 = SteadyNanos();
    Status st = RunCachedStep(*host_->model, experts, host_->prefix_cache, max_rows, items, states, samplers,
                              &scratch_, &merged_out_, &merged_cached_);
    host_->merge_queue.RecordStep(static_cast<double>(SteadyNanos() - t0) * 1e-9);
    if (sessions.size() > 1) {
      host_->merged_steps.fetch_add(static_cast<uint64_t>(sessions.size()));
      host_->merged_passes.fetch_add(1);
    }
    merged_out_.cached = merged_cached_;
    for (size_t k = 0; k < sessions.size(); ++k) {
      WorkerSession* s = sessions[k];
      Status part = st.ok() ? parts[k].status : st;
      if (part.ok()) {
        SliceStepOutput(merged_out_, items, begin[k], begin[k + 1], &s->out_);
        s->cached_ = s->out_.cached;
      }
      s->UnclaimAll();
      if (pending[k] == &me) {
        own = part;
      } else {
        host_->merge_queue.Finish(pending[k], part);
      }
    }
  }
  RETURN_IF_ERROR(own);
  WriteOutputs(n, rows);
  return absl::OkStatus();
}

void WorkerSession::WriteOutputs(int64_t n, int64_t rows) {
  shm::MsgHeader& out = channel_->outgoing();
  const int64_t vocab = host_->model->vocab_size();
  const shm::Geometry& g = channel_->geometry();
  ReportCache(&out);

  int64_t drafted_total = 0, accepted_total = 0, spec_steps = 0;
  for (int64_t i = 0; i < n; ++i) {
    channel_->sampled()[i] = out_.tokens[i];
    channel_->counts()[i] = out_.counts[i];
    channel_->drafted()[i] = out_.drafted[i];
    channel_->accepted()[i] = out_.accepted[i];
    channel_->cached()[i] = cached_[i];
    if (out_.drafted[i] > 0) {
      drafted_total += out_.drafted[i];
      accepted_total += out_.accepted[i];
      ++spec_steps;
    }
  }
  std::copy(out_.emitted.begin(), out_.emitted.end(), channel_->emitted());
  for (size_t k = 0; k < out_.logprobs.size(); ++k) {
    const EmittedLogprobs& lp = out_.logprobs[k];
    shm::WireLogprob* row = channel_->logprobs() + k * (1 + shm::kMaxWireTopLogprobs);
    row[0] = shm::WireLogprob{lp.chosen.token, lp.chosen.logprob};
    for (size_t j = 0; j < lp.top.size() && j < shm::kMaxWireTopLogprobs; ++j) {
      row[1 + j] = shm::WireLogprob{lp.top[j].token, lp.top[j].logprob};
    }
  }
  out.num_logprobs = static_cast<int64_t>(out_.logprobs.size());
  for (size_t r = 0; r < out_.logits.size(); ++r) {
    std::memcpy(channel_->logits() + r * g.vocab, out_.logits[r].data(), static_cast<size_t>(vocab) * sizeof(float));
  }
  out.num_entries = n;
  out.num_logits = static_cast<int64_t>(out_.logits.size());
  out.num_emitted = static_cast<int64_t>(out_.emitted.size());
  steps_.fetch_add(1);
  tokens_.fetch_add(static_cast<uint64_t>(rows));
  host_->steps.fetch_add(1);
  host_->tokens.fetch_add(static_cast<uint64_t>(rows));
  if (spec_steps > 0) {
    host_->spec_steps.fetch_add(static_cast<uint64_t>(spec_steps));
    host_->spec_drafted.fetch_add(static_cast<uint64_t>(drafted_total));
    host_->spec_accepted.fetch_add(static_cast<uint64_t>(accepted_total));
  }
}

}  // namespace numoe::gpu
