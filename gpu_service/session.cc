#include "gpu_service/session.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>

#include "common/log.h"
#include "model/spec.h"

namespace numoe::gpu {

int64_t SteadyMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

WorkerSession::WorkerSession(ModelHost* host, SessionInfo info, std::unique_ptr<shm::Channel> channel)
    : host_(host), info_(std::move(info)), channel_(std::move(channel)), experts_(channel_.get(), &host->hops) {
  Touch();
}

WorkerSession::~WorkerSession() { Stop(); }

void WorkerSession::Touch() { last_heartbeat_ms_.store(SteadyMillis()); }

Status WorkerSession::end_status() const {
  std::lock_guard<std::mutex> lk(status_mu_);
  return end_status_;
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
  ReleaseAll();
}

void WorkerSession::ReleaseAll() {
  if (seqs_.empty()) return;
  std::lock_guard<std::mutex> lk(host_->forward_mu);
  for (auto& [key, s] : seqs_) (void)host_->model->ReleaseSequence(s.model_seq);
  seqs_.clear();
  num_seqs_.store(0);
}

void WorkerSession::Serve() {
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

Status WorkerSession::HandleStep() {
  const shm::MsgHeader& m = channel_->incoming();
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
  // Copy what the model will read: the worker must not be able to change it under a running Forward.
  const int64_t n = m.num_entries;
  entries_.assign(channel_->entries(), channel_->entries() + n);
  tokens_buf_.assign(channel_->tokens(), channel_->tokens() + m.num_tokens);
  std::vector<int64_t> releases(channel_->releases(), channel_->releases() + m.num_releases);

  // Releases first (unknown keys are ignored: a release may race with the session's own cleanup).
  if (!releases.empty()) {
    std::lock_guard<std::mutex> lk(host_->forward_mu);
    for (int64_t key : releases) {
      auto it = seqs_.find(key);
      if (it == seqs_.end()) continue;
      (void)host_->model->ReleaseSequence(it->second.model_seq);
      seqs_.erase(it);
    }
    num_seqs_.store(static_cast<int64_t>(seqs_.size()));
  }
  shm::MsgHeader& out = channel_->outgoing();
  out.num_entries = 0;
  out.num_logits = 0;
  out.num_emitted = 0;
  if (n == 0) return absl::OkStatus();

  // Validate every entry before touching the model.
  const int64_t vocab = host_->model->vocab_size();
  int64_t total = 0, rows = 0, logits_rows = 0;
  std::set<int64_t> seen;
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    const std::string at = absl::StrCat("entries[", i, "] (sequence ", e.seq, ")");
    if (!seen.insert(e.seq).second) return bad(absl::StrCat(at, ": the sequence appears twice"));
    if (e.num_tokens < 1) return bad(absl::StrCat(at, ": num_tokens ", e.num_tokens, " < 1"));
    if (total + e.num_tokens > m.num_tokens) return bad(absl::StrCat(at, ": tokens run past num_tokens"));
    for (int32_t k = 0; k < e.num_tokens; ++k) {
      const int32_t t = tokens_buf_[total + k];
      if (t < 0 || t >= vocab) {
        return bad(absl::StrCat(at, ": token ", k, " = ", t, " is out of range [0, ", vocab, ")"));
      }
    }
    total += e.num_tokens;
    if ((e.flags & ~(shm::kEntryOpen | shm::kEntrySample | shm::kEntryLogits)) != 0) {
      return bad(absl::StrCat(at, ": unknown flags 0x", absl::Hex(e.flags)));
    }
    const bool exists = seqs_.count(e.seq) != 0;
    if ((e.flags & shm::kEntryOpen) != 0) {
      if (exists) return bad(absl::StrCat(at, ": opened twice"));
      SamplingParams p{e.sampling.temperature, e.sampling.top_p, e.sampling.top_k, e.sampling.seed};
      if (Status st = ValidateSampling(p); !st.ok()) return bad(absl::StrCat(at, ": sampling.", st.message()));
    } else if (!exists) {
      return bad(absl::StrCat(at, ": unknown sequence (not opened, or already released)"));
    }
    if ((e.flags & shm::kEntryLogits) != 0 && ++logits_rows > g.logits_rows) {
      return bad(absl::StrCat(at, ": more logits requested than the channel's logits_rows (", g.logits_rows, ")"));
    }
    // Speculative fields.
    if (e.drafts < 0 || e.model_drafts < 0) {
      return bad(absl::StrCat(at, ": drafts ", e.drafts, " / model_drafts ", e.model_drafts, " must be >= 0"));
    }
    if (e.drafts > 0 || e.model_drafts > 0) {
      const char* field = e.drafts > 0 ? "drafts" : "model_drafts";
      if (e.drafts > 0 && e.model_drafts > 0) return bad(absl::StrCat(at, ": both drafts and model_drafts are set"));
      if (g.verify == 0) {
        return bad(absl::StrCat(at, ": ", field, " set, but this numoe-gpu's backend cannot verify drafts"));
      }
      if ((e.flags & shm::kEntrySample) == 0) return bad(absl::StrCat(at, ": ", field, " without the sample flag"));
      if ((e.flags & shm::kEntryLogits) != 0) return bad(absl::StrCat(at, ": ", field, " with the logits flag"));
      if ((e.flags & shm::kEntryOpen) != 0) {
        return bad(absl::StrCat(at, ": ", field, " on the step that opens the sequence (nothing to verify against)"));
      }
      if (e.drafts >= e.num_tokens) {
        return bad(absl::StrCat(at, ": drafts ", e.drafts, " must be < num_tokens ", e.num_tokens,
                                " (the last sampled token comes first)"));
      }
      if (e.model_drafts > 0) {
        if (g.drafter == SpecMethod::kNone) {
          return bad(absl::StrCat(at, ": model_drafts ", e.model_drafts, " but numoe-gpu has no model drafter"));
        }
        if (e.model_drafts > static_cast<int64_t>(g.max_model_drafts)) {
          return bad(absl::StrCat(at, ": model_drafts ", e.model_drafts, " > the channel's max_model_drafts ",
                                  g.max_model_drafts));
        }
        if (e.num_tokens != 1) {
          return bad(absl::StrCat(at, ": model_drafts needs num_tokens 1 (got ", e.num_tokens, ")"));
        }
      }
    }
    rows += int64_t{e.num_tokens} + e.model_drafts;
  }
  if (total != m.num_tokens) return bad(absl::StrCat("entries hold ", total, " tokens, num_tokens says ", m.num_tokens));
  if (rows > g.max_rows) {
    return bad(absl::StrCat("num_tokens + model_drafts over the entries is ", rows, ", more than max_rows ", g.max_rows));
  }

  std::lock_guard<std::mutex> lk(host_->forward_mu);
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    if ((e.flags & shm::kEntryOpen) == 0) continue;
    ASSIGN_OR_RETURN(SequenceId id, host_->model->CreateSequence());
    SamplingParams p{e.sampling.temperature, e.sampling.top_p, e.sampling.top_k, e.sampling.seed};
    seqs_.emplace(e.seq, Seq{id, Sampler(p)});
  }
  num_seqs_.store(static_cast<int64_t>(seqs_.size()));

  // The model drafter, batched over every entry that asks for it (its MoE goes over the channel as the
  // stage layers num_hidden_layers + s). It may propose fewer than asked: those entries verify fewer.
  feed_.resize(static_cast<size_t>(n));
  draft_logits_.resize(static_cast<size_t>(n));
  num_drafts_.assign(static_cast<size_t>(n), 0);
  std::vector<DraftRequest> dreqs;
  std::vector<int64_t> draft_owner;
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    feed_[i].assign(tokens_buf_.begin() + at, tokens_buf_.begin() + at + e.num_tokens);
    draft_logits_[i].clear();
    num_drafts_[i] = e.drafts;
    at += e.num_tokens;
    if (e.model_drafts > 0) {
      dreqs.push_back(DraftRequest{.seq = seqs_.at(e.seq).model_seq,
                                   .next_token = feed_[i][0],
                                   .depth = e.model_drafts,
                                   .sampler = &seqs_.at(e.seq).sampler});
      draft_owner.push_back(i);
    }
  }
  if (!dreqs.empty()) {
    std::vector<DraftResult> drafted;
    RETURN_IF_ERROR(host_->model->Draft(dreqs, &experts_, &drafted));
    if (drafted.size() != dreqs.size()) {
      return absl::InternalError(absl::StrCat("the drafter returned ", drafted.size(), " results for ", dreqs.size(),
                                              " requests"));
    }
    for (size_t j = 0; j < drafted.size(); ++j) {
      const int64_t i = draft_owner[j];
      DraftResult& d = drafted[j];
      const size_t k = std::min<size_t>(d.tokens.size(), static_cast<size_t>(entries_[i].model_drafts));
      if (d.logits.size() < k * static_cast<size_t>(vocab)) {
        return absl::InternalError(absl::StrCat("the drafter returned ", d.logits.size(), " logits for ", k, " drafts"));
      }
      feed_[i].insert(feed_[i].end(), d.tokens.begin(), d.tokens.begin() + static_cast<std::ptrdiff_t>(k));
      draft_logits_[i].assign(d.logits.begin(), d.logits.begin() + static_cast<std::ptrdiff_t>(k * vocab));
      num_drafts_[i] = static_cast<int32_t>(k);
    }
  }

  steps_buf_.clear();
  for (int64_t i = 0; i < n; ++i) {
    const bool spec = num_drafts_[i] > 0;
    steps_buf_.push_back(SequenceStep{.seq = seqs_.at(entries_[i].seq).model_seq,
                                      .tokens = std::span<const int32_t>(feed_[i]),
                                      .all_logits = spec,
                                      .speculative = spec});
  }
  RETURN_IF_ERROR(host_->model->Forward(steps_buf_, &experts_, &logits_));
  if (static_cast<int64_t>(logits_.size()) != n) {
    return absl::InternalError(absl::StrCat("model returned ", logits_.size(), " logit sets for ", n, " sequences"));
  }
  int64_t row = 0, emitted = 0, drafted_total = 0, accepted_total = 0, spec_steps = 0;
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    const SequenceLogits& lg = logits_[i];
    Seq& s = seqs_.at(e.seq);
    const int64_t k = num_drafts_[i];
    channel_->drafted()[i] = static_cast<int32_t>(k);
    channel_->accepted()[i] = 0;
    if (k > 0) {
      // Rows of [last token, d_0 .. d_{k-1}]: the last k + 1 of the step's rows.
      if (lg.rows < k + 1) {
        return absl::InternalError(absl::StrCat("speculative step returned ", lg.rows, " logit rows for ", k, " drafts"));
      }
      const std::span<const int32_t> drafts(feed_[i].data() + feed_[i].size() - k, static_cast<size_t>(k));
      const Verdict v = VerifyDrafts(s.sampler, drafts, draft_logits_[i], lg.logits.data() + (lg.rows - k - 1) * vocab,
                                     vocab);
      if (v.accepted < k) RETURN_IF_ERROR(host_->model->Rollback(s.model_seq, k - v.accepted));
      std::copy(v.tokens.begin(), v.tokens.end(), channel_->emitted() + emitted);
      channel_->sampled()[i] = v.tokens.front();
      channel_->counts()[i] = static_cast<int32_t>(v.tokens.size());
      channel_->accepted()[i] = static_cast<int32_t>(v.accepted);
      emitted += static_cast<int64_t>(v.tokens.size());
      drafted_total += k;
      accepted_total += v.accepted;
      ++spec_steps;
      continue;
    }
    const float* last = lg.logits.data() + (lg.rows - 1) * vocab;
    if ((e.flags & shm::kEntrySample) != 0) {
      const int32_t t = s.sampler.Sample(last, vocab);
      channel_->sampled()[i] = t;
      channel_->counts()[i] = 1;
      channel_->emitted()[emitted++] = t;
    } else {
      channel_->sampled()[i] = -1;
      channel_->counts()[i] = 0;
    }
    if ((e.flags & shm::kEntryLogits) != 0) {
      std::memcpy(channel_->logits() + row++ * g.vocab, last, static_cast<size_t>(vocab) * sizeof(float));
    }
  }
  out.num_entries = n;
  out.num_logits = row;
  out.num_emitted = emitted;
  steps_.fetch_add(1);
  tokens_.fetch_add(static_cast<uint64_t>(rows));
  host_->steps.fetch_add(1);
  host_->tokens.fetch_add(static_cast<uint64_t>(rows));
  if (spec_steps > 0) {
    host_->spec_steps.fetch_add(static_cast<uint64_t>(spec_steps));
    host_->spec_drafted.fetch_add(static_cast<uint64_t>(drafted_total));
    host_->spec_accepted.fetch_add(static_cast<uint64_t>(accepted_total));
  }
  return absl::OkStatus();
}

}  // namespace numoe::gpu
