// The DSpark drafter on the CPU backend (docs/dsv4-architecture.md §4.2): three V4 blocks with sliding
// attention over their own rings of target features, a bidirectional draft block, the shared head and a
// sequential Markov correction.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/cpu_model.h"
#include "backends/cpu/cpu_model_state.h"
#include "backends/cpu/ops.h"

namespace numoe::cpu {

void CpuModel::FeedDrafter(const Rows& rows, const std::vector<float>& features) {
  const int64_t n = rows.n, D = cfg_.hidden_size, hd = cfg_.head_dim, rd = cfg_.rope_dim, W = cfg_.sliding_window;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> main_x(static_cast<size_t>(n * D)), kv(static_cast<size_t>(n * hd));
  MatMul(features.data(), n, dspark_->main_proj, main_x.data(), pool_);
  for (int64_t r = 0; r < n; ++r) RmsNorm(&main_x[r * D], dspark_->main_norm.data(), D, eps, &main_x[r * D]);
  for (size_t s = 0; s < dspark_->stages.size(); ++s) {
    const AttentionW& a = dspark_->stages[s].attn;
    MatMul(main_x.data(), n, a.wkv, kv.data(), pool_);
    for (int64_t r = 0; r < n; ++r) {
      RmsNorm(&kv[r * hd], a.kv_norm.data(), hd, eps, &kv[r * hd]);
      ApplyRope(&kv[r * hd], hd, rd, inv_freq_main_.data(), rows.pos[r]);
    }
    for (const Rows::Seq& q : rows.seqs) {
      const bool spec = q.state->undo_from >= 0;
      std::vector<float>& ring = q.state->drafter_rings[s];
      for (int64_t r = spec ? q.begin : std::max(q.begin, q.end - W); r < q.end; ++r) {
        float* slot = &ring[(rows.pos[r] % W) * hd];
        if (spec) q.state->drafter_undo[s].emplace_back(rows.pos[r], std::vector<float>(slot, slot + hd));
        std::memcpy(slot, &kv[r * hd], static_cast<size_t>(hd) * sizeof(float));
      }
    }
  }
}

Status CpuModel::DraftDspark(std::span<const DraftRequest> requests, ExpertBackend* experts,
                       std::vector<DraftResult>* out) {
  if (dspark_ == nullptr) return absl::FailedPreconditionError("the DSpark drafter is not loaded");
  if (experts == nullptr) return absl::InvalidArgumentError("Draft: no expert backend");
  const int64_t D = cfg_.hidden_size, k = cfg_.hc_mult, H = cfg_.num_attention_heads, hd = cfg_.head_dim;
  const int64_t rd = cfg_.rope_dim, W = cfg_.sliding_window, V = cfg_.vocab_size, qr = cfg_.q_lora_rank;
  const int64_t mr = cfg_.dspark_markov_rank;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  struct Block {
    SeqState* state;
    int64_t begin, end, last;  // rows; `last` = position of the sequence's last consumed token
  };
  std::vector<Block> blocks;
  std::vector<int32_t> ids;
  std::vector<int64_t> row_seqs;  // [rows]: MoeRequest::seqs
  std::vector<int64_t> pos;
  for (const DraftRequest& q : requests) {
    auto it = seqs_.find(q.seq);
    if (it == seqs_.end()) return absl::NotFoundError(absl::StrCat("sequence ", q.seq, " does not exist"));
    RETURN_IF_ERROR(ValidateDraftRequest(q, V));
    if (it->second->position < 1) return absl::FailedPreconditionError("Draft: the sequence has consumed no token");
    Block b{it->second.get(), static_cast<int64_t>(ids.size()), static_cast<int64_t>(ids.size()) + q.depth,
            it->second->position - 1};
    for (int64_t i = 0; i < q.depth; ++i) {
      ids.push_back(i == 0 ? q.next_token : dspark_->noise_token);
      row_seqs.push_back(q.seq);
      pos.push_back(b.last + 1 + i);
    }
    blocks.push_back(b);
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  std::vector<float> X(static_cast<size_t>(n * k * D));
  for (int64_t r = 0; r < n; ++r) {
    float* e = &X[r * k * D];
    w_->embed.Row(ids[r], e);
    for (int64_t j = 1; j < k; ++j) std::memcpy(e + j * D, e, static_cast<size_t>(D) * sizeof(float));
  }
  std::vector<float> u(static_cast<size_t>(n * D)), xn(u.size()), y(u.size());
  std::vector<float> post(static_cast<size_t>(n * k)), comb(static_cast<size_t>(n * k * k));
  std::vector<float> qa(static_cast<size_t>(n * qr)), q(static_cast<size_t>(n * H * hd)), kv(static_cast<size_t>(n * hd));
  std::vector<float> o(static_cast<size_t>(n * H * hd)), scratch;
  std::vector<const float*> keys;
  const float* inv = inv_freq_main_.data();
  for (size_t s = 0; s < dspark_->stages.size(); ++s) {
    const LayerW& L = dspark_->stages[s];
    HyperPre(L.hc_attn, X.data(), n, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < n; ++r) RmsNorm(&u[r * D], L.attn_norm.data(), D, eps, &xn[r * D]);
    ProjectQueryKv(L.attn, xn.data(), n, pos.data(), inv, qa.data(), q.data(), kv.data());
    for (const Block& b : blocks) {
      // The ring (target features of the last W positions) plus the whole block, bidirectionally.
      keys.clear();
      const std::vector<float>& ring = b.state->drafter_rings[s];
      for (int64_t p = std::max<int64_t>(0, b.last - W + 1); p <= b.last; ++p) keys.push_back(&ring[(p % W) * hd]);
      for (int64_t r = b.begin; r < b.end; ++r) keys.push_back(&kv[r * hd]);
      for (int64_t r = b.begin; r < b.end; ++r) {
        AttendRow(&q[r * H * hd], keys, L.attn.sink.data(), H, hd, rd, inv, pos[r], &o[r * H * hd], &scratch);
      }
    }
    OutputProjection(L.attn, o.data(), n, y.data());
    HyperPost(y.data(), post.data(), comb.data(), n, X.data());
    HyperPre(L.hc_ffn, X.data(), n, u.data(), post.data(), comb.data());
    for (int64_t r = 0; r < n; ++r) RmsNorm(&u[r * D], L.ffn_norm.data(), D, eps, &xn[r * D]);
    RETURN_IF_ERROR(Moe(L.ffn, cfg_.num_hidden_layers + static_cast<int64_t>(s), n, ids.data(), row_seqs.data(),
                        xn.data(), y.data(),
                        experts));
    HyperPost(y.data(), post.data(), comb.data(), n, X.data());
  }
  // Head of the last stage, then the sequential Markov correction and the confidence logits.
  std::vector<float> h_pre(static_cast<size_t>(n * D)), h(static_cast<size_t>(n * D));
  for (int64_t r = 0; r < n; ++r) {
    CollapseStreams(dspark_->hc_head, &X[r * k * D], &h_pre[r * D]);
    RmsNorm(&h_pre[r * D], dspark_->norm.data(), D, eps, &h[r * D]);
  }
  std::vector<float> logits(static_cast<size_t>(n * V)), bias(static_cast<size_t>(V));
  // The confidence head's input [h_pre; markov_w1[prev]]: its markov part doubles as the Markov row.
  std::vector<float> cin(static_cast<size_t>(D + mr));
  float* m = cin.data() + D;
  MatMul(h.data(), n, w_->Head(), logits.data(), pool_);
  out->clear();
  for (size_t i = 0; i < blocks.size(); ++i) {
    const Block& b = blocks[i];
    DraftResult res;
    res.seq = requests[i].seq;
    int32_t prev = requests[i].next_token;
    for (int64_t r = b.begin; r < b.end; ++r) {
      dspark_->markov_w1.Row(prev, m);
      MatMul(m, 1, dspark_->markov_w2, bias.data(), pool_);
      float* lr = &logits[r * V];
      for (int64_t v = 0; v < V; ++v) lr[v] += bias[v];
      const int32_t d = requests[i].sampler ? requests[i].sampler->SampleDraft(lr, V) : Argmax(lr, V);
      res.tokens.push_back(d);
      res.logits.insert(res.logits.end(), lr, lr + V);
      std::memcpy(cin.data(), &h_pre[r * D], static_cast<size_t>(D) * sizeof(float));
      float conf = 0.0f;
      MatMul(cin.data(), 1, dspark_->confidence, &conf);
      res.confidence.push_back(conf);
      prev = d;
    }
    out->push_back(std::move(res));
  }
  return absl::OkStatus();
}

}  // namespace numoe::cpu
