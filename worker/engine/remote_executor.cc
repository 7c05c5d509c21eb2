#include "worker/engine/remote_executor.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/clock.h"

namespace numoe::engine {

RemoteExecutor::RemoteExecutor(shm::Channel* channel, ExpertBackend* experts, ExecSeq first_key)
    : ch_(channel), experts_(experts), next_(first_key) {}

StatusOr<SeqHandoff> RemoteExecutor::Detach(ExecSeq seq) {
  for (const PendingFork& f : forks_) {
    if (f.seq == seq || f.parent == seq) {
      return absl::FailedPreconditionError(absl::StrCat("executor: sequence ", seq, " has a fork still to be sent"));
    }
  }
  if (auto p = pending_open_.find(seq); p != pending_open_.end()) {
    SeqHandoff h{.seq = seq, .opened = false, .sampling = std::move(p->second)};
    h.logprobs = h.sampling.logprobs;
    pending_open_.erase(p);
    return h;
  }
  auto it = open_.find(seq);
  if (it == open_.end()) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", seq));
  SeqHandoff h{.seq = seq, .opened = true, .logprobs = it->second};
  open_.erase(it);
  return h;
}

Status RemoteExecutor::Adopt(const SeqHandoff& h) {
  if (pending_open_.count(h.seq) != 0 || open_.count(h.seq) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("executor: sequence ", h.seq, " is already here"));
  }
  if (h.opened) {
    open_.emplace(h.seq, h.logprobs);
  } else {
    pending_open_.emplace(h.seq, h.sampling);
  }
  return absl::OkStatus();
}

ExecutorLimits RemoteExecutor::limits() const {
  const shm::Geometry& g = ch_->geometry();
  return ExecutorLimits{.vocab_size = g.vocab,
                        .max_step_tokens = g.max_rows,
                        .max_seqs = g.max_seqs,
                        .logits = g.logits_rows > 0,
                        .model = ChannelCapabilities(g)};
}

PrefixCacheFigures RemoteExecutor::prefix_cache() const {
  std::lock_guard<std::mutex> lk(prefix_mu_);
  return prefix_cache_;
}

Status RemoteExecutor::Broken(const Status& st) {
  if (broken_.ok()) broken_ = Status(st.code(), absl::StrCat("numoe-gpu channel: ", st.message()));
  return broken_;
}

StatusOr<ExecSeq> RemoteExecutor::Open(const SamplingParams& sampling) {
  RETURN_IF_ERROR(broken_);
  RETURN_IF_ERROR(ValidateSampling(sampling, ch_->geometry().vocab));
  const int64_t max_seqs = ch_->geometry().max_seqs;
  if (static_cast<int64_t>(pending_open_.size() + forks_.size() + open_.size()) >= max_seqs) {
    return absl::ResourceExhaustedError(absl::StrCat("executor: ", max_seqs, " sequences are already open"));
  }
  const ExecSeq id = next_++;
  pending_open_.emplace(id, sampling);
  return id;
}

StatusOr<ExecSeq> RemoteExecutor::Fork(ExecSeq parent, const SamplingParams& sampling) {
  RETURN_IF_ERROR(broken_);
  if (ch_->geometry().fork == 0) return absl::UnimplementedError("executor: numoe-gpu cannot fork sequences");
  RETURN_IF_ERROR(ValidateSampling(sampling, ch_->geometry().vocab));
  if (open_.count(parent) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("executor: fork of sequence ", parent, ", which has not run a step (or is closed)"));
  }
  const int64_t max_seqs = ch_->geometry().max_seqs;
  if (static_cast<int64_t>(pending_open_.size() + forks_.size() + open_.size()) >= max_seqs) {
    return absl::ResourceExhaustedError(absl::StrCat("executor: ", max_seqs, " sequences are already open"));
  }
  const ExecSeq id = next_++;
  forks_.push_back(PendingFork{id, parent, sampling});
  return id;
}

Status RemoteExecutor::Close(ExecSeq seq) {
  if (pending_open_.erase(seq) != 0) return absl::OkStatus();
  for (auto it = forks_.begin(); it != forks_.end(); ++it) {
    if (it->seq == seq) {
      forks_.erase(it);
      return absl::OkStatus();
    }
  }
  if (open_.erase(seq) == 0) return absl::NotFoundError(absl::StrCat("executor: no open sequence ", seq));
  releases_.push_back(seq);
  return absl::OkStatus();
}

Status RemoteExecutor::Flush() {
  if ((releases_.empty() && forks_.empty()) || !broken_.ok()) return absl::OkStatus();
  StepOutput unused;
  return Exchange({}, &unused);
}

Status RemoteExecutor::Step(std::span<const StepItem> items, StepOutput* out) {
  RETURN_IF_ERROR(broken_);
  if (items.empty()) return absl::InvalidArgumentError("executor: empty step");
  return Exchange(items, out);
}

Status RemoteExecutor::Exchange(std::span<const StepItem> items, StepOutput* out) {
  RETURN_IF_ERROR(broken_);
  const shm::Geometry& g = ch_->geometry();
  if (items.size() > g.max_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("executor: ", items.size(), " sequences in one step, the channel holds ",
                                                   g.max_seqs));
  }
  // More releases than one message holds cannot happen while at most max_seqs are open; guard anyway.
  if (releases_.size() > g.max_seqs) releases_.resize(g.max_seqs);

  const Capabilities caps = ChannelCapabilities(g);
  shm::MsgHeader& m = ch_->outgoing();
  int64_t tokens = 0, rows = 0, logits_rows = 0, biases = 0, grammar_bytes = 0;
  // Logit biases go to `biases`, forks' first, then the opening entries' (in entry order).
  auto put_biases = [&](const SamplingParams& p) {
    for (const auto& [token, bias] : p.logit_bias) ch_->biases()[biases++] = shm::WireBias{token, bias};
  };
  if (forks_.size() > g.max_seqs) return absl::InternalError("executor: more pending forks than the channel holds");
  for (size_t i = 0; i < forks_.size(); ++i) {
    ch_->forks()[i] = shm::WireFork{.seq = forks_[i].seq, .parent = forks_[i].parent,
                                    .sampling = ToWireSampling(forks_[i].sampling)};
    ch_->forks()[i].sampling.grammar_bytes = 0;  // a fork follows its parent's grammar
    put_biases(forks_[i].sampling);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const StepItem& it = items[i];
    // numoe-gpu runs the same checks (ValidateStepItem); failing here keeps a bad item from costing a round trip.
    if (Status st = ValidateStepItem(it, caps, g.vocab); !st.ok()) {
      return Status(st.code(), absl::StrCat("executor: item ", i, ": ", st.message()));
    }
    if (it.all_logits) {
      return absl::InvalidArgumentError(absl::StrCat("executor: item ", i, ": all_logits does not travel over the channel"));
    }
    if (rows + it.rows() > g.max_rows) {
      return absl::InvalidArgumentError(absl::StrCat("executor: the step has more than ", g.max_rows,
                                                     " rows, tokens + model drafts (the channel's max_rows)"));
    }
    shm::StepEntry& e = ch_->entries()[i];
    e = shm::StepEntry{};
    e.seq = it.seq;
    e.num_tokens = static_cast<int32_t>(it.tokens.size());
    e.drafts = it.drafts;
    e.model_drafts = it.model_drafts;
    if (auto p = pending_open_.find(it.seq); p != pending_open_.end()) {
      e.flags |= shm::kEntryOpen;
      e.sampling = ToWireSampling(p->second);
      put_biases(p->second);
      const std::string& grammar = p->second.grammar;
      if (grammar_bytes + static_cast<int64_t>(grammar.size()) > shm::kMaxWireGrammarBytes) {
        return absl::ResourceExhaustedError(absl::StrCat("executor: the grammars of the sequences opened in one step "
                                                         "exceed the channel's ", shm::kMaxWireGrammarBytes, " bytes"));
      }
      std::memcpy(ch_->grammars() + grammar_bytes, grammar.data(), grammar.size());
      grammar_bytes += static_cast<int64_t>(grammar.size());
    } else if (open_.count(it.seq) == 0 &&
               std::none_of(forks_.begin(), forks_.end(), [&](const PendingFork& f) { return f.seq == it.seq; })) {
      // (A pending fork is made by numoe-gpu before this step runs.)
      return absl::NotFoundError(absl::StrCat("executor: no open sequence ", it.seq));
    }
    if (it.sample) e.flags |= shm::kEntrySample;
    if (it.logits) {
      if (logits_rows >= g.logits_rows) {
        return absl::InvalidArgumentError("executor: more logits requested than the channel's logits_rows");
      }
      e.flags |= shm::kEntryLogits;
      ++logits_rows;
    }
    std::memcpy(ch_->tokens() + tokens, it.tokens.data(), it.tokens.size() * sizeof(int32_t));
    tokens += static_cast<int64_t>(it.tokens.size());
    rows += it.rows();
  }
  for (size_t i = 0; i < releases_.size(); ++i) ch_->releases()[i] = releases_[i];
  m.num_entries = static_cast<int64_t>(items.size());
  m.num_tokens = tokens;
  m.num_releases = static_cast<int64_t>(releases_.size());
  m.num_forks = static_cast<int64_t>(forks_.size());
  m.num_biases = biases;
  m.num_grammar_bytes = grammar_bytes;
  if (Status st = ch_->Send(shm::MsgType::kStepRequest); !st.ok()) return Broken(st);
  // The gpu has the step: whatever the outcome, it processed the releases and may have made these.
  releases_.clear();
  for (const PendingFork& f : forks_) open_.emplace(f.seq, f.sampling.logprobs);
  forks_.clear();
  for (const StepItem& it : items) {
    if (auto p = pending_open_.find(it.seq); p != pending_open_.end()) {
      open_.emplace(it.seq, p->second.logprobs);
      pending_open_.erase(p);
    }
  }

  Status expert_error;
  for (;;) {
    auto type = ch_->Receive(-1);
    if (!type.ok()) return Broken(type.status());
    const shm::MsgHeader& in = ch_->incoming();
    switch (*type) {
      case shm::MsgType::kMoeRequest: {
        moe_requests_.fetch_add(1, std::memory_order_relaxed);
        Status st;
        if (in.rows < 0 || in.rows > g.max_rows || in.top_k < 1 || in.top_k > g.top_k || in.layer < 0) {
          st = absl::InvalidArgumentError(absl::StrCat("MoeRequest: layer ", in.layer, " rows ", in.rows, " top_k ",
                                                       in.top_k, " outside the channel's geometry"));
        } else {
          MoeRequest req{.layer = in.layer,
                         .rows = in.rows,
                         .top_k = in.top_k,
                         .x = ch_->moe_x(),
                         .expert_ids = ch_->moe_ids(),
                         .expert_weights = ch_->moe_weights(),
                         .out = ch_->moe_out()};
          const int64_t t0 = SteadyNanos();
          st = in.rows == 0 ? absl::OkStatus() : experts_->RunRouted(req);
          const int64_t dt = SteadyNanos() - t0;
          expert_ns_.fetch_add(dt, std::memory_order_relaxed);
          ch_->outgoing().compute_ns = dt;
        }
        if (st.ok()) {
          shm::MsgHeader& r = ch_->outgoing();
          r.layer = in.layer;
          r.rows = in.rows;
          if (Status s = ch_->Send(shm::MsgType::kMoeResponse); !s.ok()) return Broken(s);
        } else {
          // The gpu's Forward fails with this error and answers with an Error that ends the step.
          expert_error = Status(st.code(), absl::StrCat("experts, layer ", in.layer, ": ", st.message()));
          if (Status s = ch_->SendError(expert_error); !s.ok()) return Broken(s);
        }
        break;
      }
      case shm::MsgType::kStepResult: {
        if (!expert_error.ok()) return expert_error;
        if (in.num_entries != static_cast<int64_t>(items.size()) || in.num_logits != logits_rows ||
            in.num_emitted < 0 || in.num_emitted > rows ||
            (in.num_logprobs != 0 && in.num_logprobs != in.num_emitted)) {
          return Broken(absl::DataLossError(absl::StrCat("StepResult for ", in.num_entries, " entries, ",
                                                         in.num_logits, " logit rows, ", in.num_emitted,
                                                         " emitted tokens and ", in.num_logprobs,
                                                         " log-prob rows; expected ", items.size(), ", ", logits_rows,
                                                         ", at most ", rows, " and 0 or as many as emitted")));
        }
        return ReadResult(items, in.num_emitted, in.num_logprobs > 0, out);
      }
      case shm::MsgType::kError:
        return expert_error.ok() ? ch_->IncomingError() : expert_error;
      default:
        return Broken(absl::DataLossError(
            absl::StrCat("unexpected ", shm::MsgTypeName(*type), " while waiting for a step's result")));
    }
  }
}

Status RemoteExecutor::ReadResult(std::span<const StepItem> items, int64_t num_emitted, bool logprobs,
                                  StepOutput* out) {
  const shm::Geometry& g = ch_->geometry();
  const size_t n = items.size();
  out->Reset(n);
  if (logprobs) out->logprobs.resize(static_cast<size_t>(num_emitted));
  int64_t row = 0, at = 0;
  for (size_t i = 0; i < n; ++i) {
    const StepItem& it = items[i];
    const int32_t count = ch_->counts()[i], drafted = ch_->drafted()[i], accepted = ch_->accepted()[i];
    // What the gpu may answer for this item: no token without sample; 1 + accepted with drafts, where
    // accepted <= drafted <= what was proposed.
    const int32_t proposed = it.drafts + it.model_drafts;
    const bool ok = it.sample ? (drafted >= 0 && drafted <= proposed && accepted >= 0 && accepted <= drafted &&
                                 count == 1 + accepted && at + count <= num_emitted)
                              : (count == 0 && drafted == 0 && accepted == 0);
    if (!ok) {
      return Broken(absl::DataLossError(absl::StrCat("StepResult entry ", i, ": count ", count, ", drafted ", drafted,
                                                     ", accepted ", accepted, " do not fit the item (sample ",
                                                     it.sample, ", ", proposed, " drafts)")));
    }
    if (count > 0) {
      const int32_t* e = ch_->emitted() + at;
      if (e[0] != ch_->sampled()[i]) {
        return Broken(absl::DataLossError(absl::StrCat("StepResult entry ", i, ": sampled ", ch_->sampled()[i],
                                                       " != its first emitted token ", e[0])));
      }
      for (int32_t k = 0; k < count; ++k) {
        if (e[k] < 0 || e[k] >= static_cast<int32_t>(g.vocab)) {
          return Broken(absl::DataLossError(absl::StrCat("StepResult entry ", i, ": emitted token ", e[k],
                                                         " outside the vocabulary")));
        }
      }
      out->tokens[i] = e[0];
      out->emitted.insert(out->emitted.end(), e, e + count);
      const auto want = open_.find(it.seq);
      // As many top entries as TopLogprobs writes (at most the vocabulary).
      const int32_t top = want == open_.end() ? -1 : static_cast<int32_t>(std::min<int64_t>(want->second, g.vocab));
      for (int32_t k = 0; logprobs && top >= 0 && k < count; ++k) {
        const shm::WireLogprob* row = ch_->logprobs() + (at + k) * (1 + shm::kMaxWireTopLogprobs);
        EmittedLogprobs& lp = out->logprobs[static_cast<size_t>(at + k)];
        for (int32_t j = 0; j <= top; ++j) {
          if (row[j].token < 0 || row[j].token >= static_cast<int32_t>(g.vocab) || (j == 0 && row[j].token != e[k])) {
            return Broken(absl::DataLossError(absl::StrCat("StepResult entry ", i, ": log-prob token ", row[j].token,
                                                           " outside the vocabulary or not the emitted one")));
          }
          const TokenLogprob t{row[j].token, row[j].logprob};
          if (j == 0) {
            lp.chosen = t;
          } else {
            lp.top.push_back(t);
          }
        }
      }
      at += count;
    }
    out->counts[i] = count;
    out->drafted[i] = drafted;
    out->accepted[i] = accepted;
    const int32_t cached = ch_->cached()[i];
    if (cached < 0 || (cached > 0 && it.speculative())) {
      return Broken(absl::DataLossError(absl::StrCat("StepResult entry ", i, ": cached ", cached,
                                                     " (must be >= 0, and 0 for a speculative entry)")));
    }
    out->cached[i] = cached;
    if (it.logits) {
      const float* l = ch_->logits() + row++ * g.vocab;
      out->logits.emplace_back(l, l + g.vocab);
    }
  }
  {
    const shm::MsgHeader& m = ch_->incoming();
    std::lock_guard<std::mutex> lk(prefix_mu_);
    prefix_cache_ = {.bytes = m.prefix_cache_bytes, .host_bytes = m.prefix_host_bytes,
                     .evicted = m.prefix_evicted, .host_evicted = m.prefix_host_evicted};
  }
  if (at != num_emitted) {
    return Broken(absl::DataLossError(absl::StrCat("StepResult: counts add up to ", at, ", num_emitted says ",
                                                   num_emitted)));
  }
  return absl::OkStatus();
}

}  // namespace numoe::engine
