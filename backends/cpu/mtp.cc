// The preview-Flash MTP drafter on the CPU backend (docs/dsv4-architecture.md §4.1): one V4 block with
// sliding attention (main rope) over its own kv ring, fed from the target's last-layer residual streams
// and the real next tokens as the target consumes them; drafting applies the block recursively.
//
// Position convention: the block's row for the pair (X_q, t_{q+1}) sits at position q+1 (the position of
// the token it embeds), so the ring holds entries 1 .. position-1 and a draft of depth K runs rows
// position .. position+K-1. Draft-time kv rows live in a local buffer only: the ring is written by Forward
// (FeedMtp) alone, with an undo log on speculative steps that Rollback replays.
#include <algorithm>
#include <cstring>

#include "backends/cpu/cpu_model.h"
#include "backends/cpu/cpu_model_state.h"
#include "backends/cpu/ops.h"

namespace numoe::cpu {

Status CpuModel::Draft(std::span<const DraftRequest> requests, ExpertBackend* experts,
                       std::vector<DraftResult>* out) {
  if (dspark_ != nullptr) return DraftDspark(requests, experts, out);
  if (mtp_ != nullptr) return DraftMtp(requests, experts, out);
  return absl::FailedPreconditionError(
      "Draft: no drafter is loaded (create the model with drafter = true on a checkpoint with DSpark or MTP stages)");
}

void CpuModel::MtpInput(const int32_t* tokens, const float* hidden, int64_t m, float* x) const {
  const int64_t D = cfg_.hidden_size, k = cfg_.hc_mult;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> en(static_cast<size_t>(m * D)), ep(en.size());
  std::vector<float> hn(static_cast<size_t>(m * k * D)), hp(hn.size());
  for (int64_t i = 0; i < m; ++i) {
    w_->embed.Row(tokens[i], &en[i * D]);
    RmsNorm(&en[i * D], mtp_->enorm.data(), D, eps, &en[i * D]);
  }
  for (int64_t r = 0; r < m * k; ++r) RmsNorm(hidden + r * D, mtp_->hnorm.data(), D, eps, &hn[r * D]);
  MatMul(en.data(), m, mtp_->e_proj, ep.data(), pool_);
  MatMul(hn.data(), m * k, mtp_->h_proj, hp.data(), pool_);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      float* xr = x + (i * k + j) * D;
      const float* hr = &hp[(i * k + j) * D];
      for (int64_t d = 0; d < D; ++d) xr[d] = ep[i * D + d] + hr[d];
    }
  }
}

void CpuModel::FeedMtp(const Rows& rows, const std::vector<float>& X) {
  const int64_t D = cfg_.hidden_size, k = cfg_.hc_mult, kd = k * D, hd = cfg_.head_dim, rd = cfg_.rope_dim;
  const int64_t W = cfg_.sliding_window;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  // The ring entries this step writes: every row of a speculative step (so undo restores in order), the
  // last W rows otherwise; position 0 has no entry (no target streams before it).
  std::vector<int32_t> tok;
  std::vector<int64_t> pos;
  std::vector<float> hid;
  std::vector<SeqState*> dest;
  for (const Rows::Seq& q : rows.seqs) {
    SeqState* st = q.state;
    const bool spec = st->undo_from >= 0;
    for (int64_t r = spec ? q.begin : std::max(q.begin, q.end - W); r < q.end; ++r) {
      const float* h = nullptr;
      if (r > q.begin) {
        h = &X[(r - 1) * kd];
      } else if (!st->mtp_x.empty()) {
        h = &st->mtp_x[st->mtp_x.size() - kd];  // X of start_pos - 1, from the previous step
      } else {
        continue;
      }
      tok.push_back(rows.token[r]);
      pos.push_back(rows.pos[r]);
      hid.insert(hid.end(), h, h + kd);
      dest.push_back(st);
    }
  }
  const int64_t m = static_cast<int64_t>(tok.size());
  if (m > 0) {
    const LayerW& L = mtp_->block;
    std::vector<float> x(static_cast<size_t>(m * kd)), u(static_cast<size_t>(m * D)), xn(u.size());
    std::vector<float> post(static_cast<size_t>(m * k)), comb(static_cast<size_t>(m * k * k));
    std::vector<float> kv(static_cast<size_t>(m * hd));
    MtpInput(tok.data(), hid.data(), m, x.data());
    HyperPre(L.hc_attn, x.data(), m, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < m; ++r) RmsNorm(&u[r * D], L.attn_norm.data(), D, eps, &xn[r * D]);
    MatMul(xn.data(), m, L.attn.wkv, kv.data(), pool_);
    for (int64_t r = 0; r < m; ++r) {
      RmsNorm(&kv[r * hd], L.attn.kv_norm.data(), hd, eps, &kv[r * hd]);
      ApplyRope(&kv[r * hd], hd, rd, inv_freq_main_.data(), pos[r]);
      SeqState* st = dest[static_cast<size_t>(r)];
      float* slot = &st->mtp_ring[(pos[r] % W) * hd];
      if (st->undo_from >= 0) st->mtp_undo.emplace_back(pos[r], std::vector<float>(slot, slot + hd));
      std::memcpy(slot, &kv[r * hd], static_cast<size_t>(hd) * sizeof(float));
    }
  }
  // The streams history: Rollback of a speculative step needs X of any of its positions and of the one
  // before it; otherwise only the last position's X is kept.
  for (const Rows::Seq& q : rows.seqs) {
    SeqState* st = q.state;
    const int64_t count = q.end - q.begin;
    if (st->undo_from >= 0) {
      std::vector<float> keep;
      keep.reserve(static_cast<size_t>((count + 1) * kd));
      if (!st->mtp_x.empty()) keep.insert(keep.end(), st->mtp_x.end() - kd, st->mtp_x.end());
      keep.insert(keep.end(), X.begin() + q.begin * kd, X.begin() + q.end * kd);
      st->mtp_x_from = q.start_pos - (st->mtp_x.empty() ? 0 : 1);
      st->mtp_x = std::move(keep);
    } else {
      st->mtp_x.assign(X.begin() + (q.end - 1) * kd, X.begin() + q.end * kd);
      st->mtp_x_from = q.start_pos + count - 1;
    }
  }
}

Status CpuModel::DraftMtp(std::span<const DraftRequest> requests, ExpertBackend* experts,
                          std::vector<DraftResult>* out) {
  if (mtp_ == nullptr) return absl::FailedPreconditionError("the MTP drafter is not loaded");
  if (experts == nullptr) return absl::InvalidArgumentError("Draft: no expert backend");
  const int64_t D = cfg_.hidden_size, k = cfg_.hc_mult, kd = k * D, H = cfg_.num_attention_heads;
  const int64_t hd = cfg_.head_dim, rd = cfg_.rope_dim, W = cfg_.sliding_window, V = cfg_.vocab_size;
  const int64_t qr = cfg_.q_lora_rank;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  struct Chain {
    SeqState* state;
    int64_t seq;               // its SequenceId (MoeRequest::seqs)
    int64_t first;             // position of the first draft row (= the sequence's position)
    int64_t depth;
    int32_t token;             // this pass's input token
    std::vector<float> hidden;  // this pass's input streams [hc, D]
    std::vector<float> kv;     // draft-time kv rows [depth, hd] (never enter the ring)
  };
  std::vector<Chain> chains;
  int64_t max_depth = 0;
  for (const DraftRequest& q : requests) {
    auto it = seqs_.find(q.seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", q.seq, " does not exist"));
    RETURN_IF_ERROR(ValidateDraftRequest(q, V));
    SeqState* st = it->second.get();
    if (st->position < 1 || st->mtp_x.empty()) {
      return absl::FailedPreconditionError("Draft: the sequence has consumed no token");
    }
    Chain c{st, q.seq, st->position, q.depth, q.next_token, {}, {}};
    c.hidden.assign(st->mtp_x.end() - kd, st->mtp_x.end());  // X of the last consumed position
    c.kv.resize(static_cast<size_t>(q.depth * hd));
    chains.push_back(std::move(c));
    max_depth = std::max(max_depth, q.depth);
  }
  out->clear();
  for (const DraftRequest& q : requests) {
    DraftResult r;
    r.seq = q.seq;
    out->push_back(std::move(r));
  }
  const LayerW& L = mtp_->block;
  const float* inv = inv_freq_main_.data();
  std::vector<size_t> act;
  std::vector<int32_t> tok;
  std::vector<int64_t> row_seqs;  // [m]: MoeRequest::seqs
  std::vector<int64_t> pos;
  std::vector<float> hid, X, u, xn, y, post, comb, qa, q, kv, o, h, logits, scratch;
  std::vector<const float*> keys;
  for (int64_t i = 0; i < max_depth; ++i) {
    // One pass of the block over every chain still drafting: row i of each.
    act.clear();
    tok.clear();
    row_seqs.clear();
    pos.clear();
    hid.clear();
    for (size_t c = 0; c < chains.size(); ++c) {
      if (chains[c].depth <= i) continue;
      act.push_back(c);
      tok.push_back(chains[c].token);
      row_seqs.push_back(chains[c].seq);
      pos.push_back(chains[c].first + i);
      hid.insert(hid.end(), chains[c].hidden.begin(), chains[c].hidden.end());
    }
    const int64_t m = static_cast<int64_t>(act.size());
    X.resize(static_cast<size_t>(m * kd));
    u.resize(static_cast<size_t>(m * D));
    xn.resize(u.size());
    y.resize(u.size());
    post.resize(static_cast<size_t>(m * k));
    comb.resize(static_cast<size_t>(m * k * k));
    qa.resize(static_cast<size_t>(m * qr));
    q.resize(static_cast<size_t>(m * H * hd));
    kv.resize(static_cast<size_t>(m * hd));
    o.resize(q.size());
    h.resize(u.size());
    logits.resize(static_cast<size_t>(m * V));
    MtpInput(tok.data(), hid.data(), m, X.data());
    HyperPre(L.hc_attn, X.data(), m, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < m; ++r) RmsNorm(&u[r * D], L.attn_norm.data(), D, eps, &xn[r * D]);
    ProjectQueryKv(L.attn, xn.data(), m, pos.data(), inv, qa.data(), q.data(), kv.data());
    for (int64_t r = 0; r < m; ++r) {
      Chain& c = chains[act[static_cast<size_t>(r)]];
      std::memcpy(&c.kv[i * hd], &kv[r * hd], static_cast<size_t>(hd) * sizeof(float));
      // Causal sliding window: ring entries before `first`, this chain's draft rows from `first` on.
      keys.clear();
      for (int64_t p = std::max<int64_t>(1, pos[r] - W + 1); p <= pos[r]; ++p) {
        keys.push_back(p < c.first ? &c.state->mtp_ring[(p % W) * hd] : &c.kv[(p - c.first) * hd]);
      }
      AttendRow(&q[r * H * hd], keys, L.attn.sink.data(), H, hd, rd, inv, pos[r], &o[r * H * hd], &scratch);
    }
    OutputProjection(L.attn, o.data(), m, y.data());
    HyperPost(y.data(), post.data(), comb.data(), m, X.data());
    HyperPre(L.hc_ffn, X.data(), m, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < m; ++r) RmsNorm(&u[r * D], L.ffn_norm.data(), D, eps, &xn[r * D]);
    RETURN_IF_ERROR(Moe(L.ffn, cfg_.num_hidden_layers, m, tok.data(), row_seqs.data(), xn.data(), y.data(), experts));
    HyperPost(y.data(), post.data(), comb.data(), m, X.data());
    for (int64_t r = 0; r < m; ++r) {
      CollapseStreams(mtp_->hc_head, &X[r * kd], &h[r * D]);
      RmsNorm(&h[r * D], mtp_->norm.data(), D, eps, &h[r * D]);
    }
    MatMul(h.data(), m, w_->Head(), logits.data(), pool_);
    for (int64_t r = 0; r < m; ++r) {
      const size_t ci = act[static_cast<size_t>(r)];
      Chain& c = chains[ci];
      const float* lr = &logits[r * V];
      Sampler* sampler = requests[ci].sampler;
      const int32_t d = sampler != nullptr ? sampler->SampleDraft(lr, V) : Argmax(lr, V);
      DraftResult& res = (*out)[ci];
      res.tokens.push_back(d);
      res.logits.insert(res.logits.end(), lr, lr + V);
      // The next pass embeds the drafted token on this pass's output streams.
      c.token = d;
      c.hidden.assign(X.begin() + r * kd, X.begin() + (r + 1) * kd);
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe::cpu
