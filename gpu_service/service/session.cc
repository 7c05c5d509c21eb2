#include "gpu_service/service/session.h"

#include <chrono>
#include <cstring>
#include <set>

#include "common/log.h"

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
  channel_->outgoing().num_entries = 0;
  channel_->outgoing().num_logits = 0;
  if (n == 0) return absl::OkStatus();

  // Validate every entry before touching the model.
  const int64_t vocab = host_->model->vocab_size();
  int64_t total = 0, logits_rows = 0;
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
  }
  if (total != m.num_tokens) return bad(absl::StrCat("entries hold ", total, " tokens, num_tokens says ", m.num_tokens));

  std::lock_guard<std::mutex> lk(host_->forward_mu);
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    if ((e.flags & shm::kEntryOpen) == 0) continue;
    ASSIGN_OR_RETURN(SequenceId id, host_->model->CreateSequence());
    SamplingParams p{e.sampling.temperature, e.sampling.top_p, e.sampling.top_k, e.sampling.seed};
    seqs_.emplace(e.seq, Seq{id, Sampler(p)});
  }
  num_seqs_.store(static_cast<int64_t>(seqs_.size()));
  steps_buf_.clear();
  int64_t at = 0;
  for (int64_t i = 0; i < n; ++i) {
    steps_buf_.push_back(SequenceStep{
        .seq = seqs_.at(entries_[i].seq).model_seq,
        .tokens = std::span<const int32_t>(tokens_buf_.data() + at, static_cast<size_t>(entries_[i].num_tokens))});
    at += entries_[i].num_tokens;
  }
  RETURN_IF_ERROR(host_->model->Forward(steps_buf_, &experts_, &logits_));
  if (static_cast<int64_t>(logits_.size()) != n) {
    return absl::InternalError(absl::StrCat("model returned ", logits_.size(), " logit sets for ", n, " sequences"));
  }
  int64_t row = 0;
  for (int64_t i = 0; i < n; ++i) {
    const shm::StepEntry& e = entries_[i];
    const SequenceLogits& lg = logits_[i];
    const float* last = lg.logits.data() + (lg.rows - 1) * vocab;
    channel_->sampled()[i] = (e.flags & shm::kEntrySample) != 0 ? seqs_.at(e.seq).sampler.Sample(last, vocab) : -1;
    if ((e.flags & shm::kEntryLogits) != 0) {
      std::memcpy(channel_->logits() + row++ * g.vocab, last, static_cast<size_t>(vocab) * sizeof(float));
    }
  }
  channel_->outgoing().num_entries = n;
  channel_->outgoing().num_logits = row;
  steps_.fetch_add(1);
  tokens_.fetch_add(static_cast<uint64_t>(total));
  host_->steps.fetch_add(1);
  host_->tokens.fetch_add(static_cast<uint64_t>(total));
  return absl::OkStatus();
}

}  // namespace numoe::gpu
