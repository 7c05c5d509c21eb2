// Sampling features through the worker's engine on tiny-v4:
//   - log-probs of the greedy tokens equal log-softmax of the golden logits, for every golden prompt, with and
//     without speculative decoding (accepted drafts take theirs from the verify rows);
//   - n choices: choice i equals a request of its own with seed ChoiceSeed(seed, i); with a forking executor the
//     prompt is prefilled once (the other choices are forked from choice 0), without one n times;
//   - greedy with penalties is the same with and without speculation (n-gram and DSpark drafts are judged
//     with the penalties of the tokens before them), and logit bias / penalties / log-probs / forks cross the
//     shared-memory channel to a gpu session with the same results as in process.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cpu/cpu_model.h"
#include "common/shm_channel.h"
#include "gpu_service/session.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"
#include "worker/engine/engine.h"
#include "worker/engine/local_executor.h"
#include "worker/engine/remote_executor.h"
#include "worker/engine/stream.h"
#include "worker/experts/reference_experts.h"

namespace numoe::engine {
namespace {

test::TinyModel* LoadTiny(bool drafter = false) {
  auto tiny = test::TinyModel::Get({.drafter = drafter});
  if (!tiny.ok()) ADD_FAILURE() << tiny.status();
  return tiny.ok() ? *tiny : nullptr;
}

void RunToEnd(Engine& engine, int max_steps = 20000) {
  for (int i = 0; i < max_steps; ++i) {
    if (!engine.StepOnce() && engine.stats().active == 0 && engine.stats().queued == 0) return;
  }
  ADD_FAILURE() << "engine did not finish within " << max_steps << " steps";
}

// Hides an executor's fork (the engine then prefills every choice) and counts forks and prompt rows.
class ForkCounter final : public Executor {
 public:
  ForkCounter(Executor* inner, bool allow_fork) : inner_(inner), allow_fork_(allow_fork) {}
  StatusOr<ExecSeq> Open(const SamplingParams& s) override { return inner_->Open(s); }
  StatusOr<ExecSeq> Fork(ExecSeq parent, const SamplingParams& s) override {
    ++forks;
    return inner_->Fork(parent, s);
  }
  Status Close(ExecSeq seq) override { return inner_->Close(seq); }
  Status Step(std::span<const StepItem> items, StepOutput* out) override {
    for (const StepItem& it : items) {
      if (!it.speculative()) rows += static_cast<int64_t>(it.tokens.size());
    }
    return inner_->Step(items, out);
  }
  Status Flush() override { return inner_->Flush(); }
  bool healthy() const override { return inner_->healthy(); }
  ExecutorLimits limits() const override {
    ExecutorLimits l = inner_->limits();
    l.model.fork = l.model.fork && allow_fork_;
    return l;
  }
  Executor* inner_;
  bool allow_fork_;
  int64_t forks = 0, rows = 0;
};

EngineRequest Greedy(const test::GoldenPrompt& g, int64_t new_tokens, int32_t logprobs = -1) {
  EngineRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = new_tokens;
  r.ignore_eos = true;
  r.sampling.logprobs = logprobs;
  r.request_id = g.name;
  return r;
}

// Every request of `reqs` through one engine, all at once; each request's choices.
std::vector<std::vector<RequestStream::Result>> RunAll(Executor* ex, const EngineOptions& o,
                                                    const std::vector<EngineRequest>& reqs, EngineStats* stats = nullptr) {
  Engine engine(ex, o);
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (const auto& r : reqs) {
    auto s = RequestStream::Open(&engine, r);
    EXPECT_OK(s);
    if (s.ok()) streams.push_back(std::move(*s));
  }
  RunToEnd(engine);
  std::vector<std::vector<RequestStream::Result>> out;
  for (auto& s : streams) {
    auto r = s->WaitAll();
    EXPECT_OK(r);
    out.push_back(r.ok() ? *r : std::vector<RequestStream::Result>{});
  }
  if (stats != nullptr) *stats = engine.stats();
  return out;
}

double GoldenLogprob(const test::GoldenPrompt& g, int64_t vocab, size_t step, int32_t token) {
  const float* row = g.step_logits.data() + step * static_cast<size_t>(vocab);
  double m = row[0];
  for (int64_t i = 0; i < vocab; ++i) m = std::max(m, static_cast<double>(row[i]));
  double s = 0;
  for (int64_t i = 0; i < vocab; ++i) s += std::exp(row[i] - m);
  return row[token] - m - std::log(s);
}

void ExpectGoldenLogprobs(const test::GoldenPrompt& g, int64_t vocab, const RequestStream::Result& r, int32_t top,
                          const std::string& what) {
  ASSERT_EQ(r.tokens, g.greedy) << what;
  ASSERT_EQ(r.logprobs.size(), g.greedy.size()) << what;
  for (size_t t = 0; t < g.greedy.size(); ++t) {
    const EmittedLogprobs& lp = r.logprobs[t];
    EXPECT_EQ(lp.chosen.token, g.greedy[t]);
    EXPECT_NEAR(lp.chosen.logprob, GoldenLogprob(g, vocab, t, g.greedy[t]), 1e-3) << what << " step " << t;
    ASSERT_EQ(lp.top.size(), static_cast<size_t>(top)) << what;
    EXPECT_EQ(lp.top[0].token, g.greedy[t]) << what << ": greedy picks the most likely";
    for (const TokenLogprob& e : lp.top) {
      EXPECT_NEAR(e.logprob, GoldenLogprob(g, vocab, t, e.token), 1e-3) << what << " step " << t;
    }
    for (size_t j = 1; j < lp.top.size(); ++j) EXPECT_GE(lp.top[j - 1].logprob, lp.top[j].logprob);
  }
}

TEST(SamplingEngine, LogprobsOfGreedyTokensEqualGoldenLogSoftmax) {
  test::TinyModel* t = LoadTiny(/*drafter=*/true);
  ASSERT_NE(t, nullptr);
  const int64_t V = t->ckpt->config().vocab_size;
  LocalExecutor local(t->model.get(), t->experts.get());
  std::vector<EngineRequest> reqs;
  for (const auto& g : t->goldens) reqs.push_back(Greedy(g, static_cast<int64_t>(g.greedy.size()), 5));
  for (SpecMethod spec : {SpecMethod::kNone, SpecMethod::kNgram, SpecMethod::kDspark}) {
    EngineOptions o{.max_seqs = 8, .max_step_tokens = 96, .prefill_chunk = 32};
    o.spec = SpecConfig{.method = spec, .depth = 4};
    EngineStats stats;
    auto out = RunAll(&local, o, reqs, &stats);
    ASSERT_EQ(out.size(), t->goldens.size());
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(out[i].size(), 1u);
      ExpectGoldenLogprobs(t->goldens[i], V, out[i][0], 5, absl::StrCat(SpecMethodName(spec), " ", t->goldens[i].name));
    }
    if (spec == SpecMethod::kNgram) {
      EXPECT_GT(stats.spec_accepted, 0) << "no accepted drafts: their log-probs untested";
    }
  }
}

TEST(SamplingEngine, NChoicesEqualSeparateRequestsAndForkPrefillsOnce) {
  test::TinyModel* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const test::GoldenPrompt& g = t->goldens[0];  // 37 tokens
  LocalExecutor local(t->model.get(), t->experts.get());
  ASSERT_TRUE(local.limits().model.fork);
  EngineRequest r = Greedy(g, 10, 2);
  r.sampling.temperature = 0.9;
  r.sampling.seed = 4242;
  r.n = 3;
  std::vector<EngineRequest> singles;
  for (int32_t i = 0; i < 3; ++i) {
    EngineRequest one = r;
    one.n = 1;
    one.sampling.seed = ChoiceSeed(r.sampling.seed, i);
    singles.push_back(one);
  }
  const EngineOptions o{.max_seqs = 8, .max_step_tokens = 64, .prefill_chunk = 16};
  ForkCounter plain(&local, /*allow_fork=*/true);
  auto separate = RunAll(&plain, o, singles);
  for (bool fork : {true, false}) {
    ForkCounter ex(&local, fork);
    EngineStats stats;
    auto out = RunAll(&ex, o, {r}, &stats);
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0].size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(out[0][i].tokens, separate[i][0].tokens) << "fork " << fork << " choice " << i;
      EXPECT_EQ(out[0][i].finish_reason, "length");
      ASSERT_EQ(out[0][i].logprobs.size(), 10u);
      for (size_t k = 0; k < 10; ++k) {
        EXPECT_NEAR(out[0][i].logprobs[k].chosen.logprob, separate[i][0].logprobs[k].chosen.logprob, 1e-5);
      }
    }
    EXPECT_NE(out[0][0].tokens, out[0][1].tokens) << "the choices sample independently";
    // Prompt rows: 37 once plus the last prompt token of the two forked choices, or 3 x 37.
    EXPECT_EQ(ex.forks, fork ? 2 : 0);
    EXPECT_EQ(stats.prompt_tokens, fork ? 37 + 2 : 3 * 37);
    EXPECT_EQ(stats.tokens_generated, 30);
    EXPECT_EQ(local.open_sequences(), 0);
  }
  // max_new_tokens 0 ends every choice at once; a one-token prompt cannot be forked (nothing to share).
  EngineRequest zero = r;
  zero.max_new_tokens = 0;
  auto z = RunAll(&local, o, {zero});
  ASSERT_EQ(z[0].size(), 3u);
  for (const auto& c : z[0]) EXPECT_EQ(c.finish_reason, "length");
  EngineRequest one_token = Greedy(t->goldens[2], 4);
  one_token.n = 2;
  ForkCounter ex(&local, true);
  auto o1 = RunAll(&ex, o, {one_token});
  EXPECT_EQ(ex.forks, 0);
  ASSERT_EQ(o1[0].size(), 2u);
  EXPECT_EQ(o1[0][0].tokens, std::vector<int32_t>(t->goldens[2].greedy.begin(), t->goldens[2].greedy.begin() + 4));
  EXPECT_EQ(o1[0][1].tokens, o1[0][0].tokens);  // greedy: every choice the same
  // n out of range is refused, naming the field.
  Engine engine(&local, o);
  EngineRequest bad = r;
  bad.n = 17;
  auto id = engine.Submit(bad, nullptr);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(id.status().message().find("n must be in [1, 16]"), std::string::npos) << id.status();
}

TEST(SamplingEngine, GreedyPenaltiesAreTheSameWithSpeculation) {
  test::TinyModel* t = LoadTiny(/*drafter=*/true);
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  std::vector<EngineRequest> reqs;
  for (const auto& g : t->goldens) {
    EngineRequest r = Greedy(g, 20, 1);
    r.sampling.frequency_penalty = 0.7;
    r.sampling.presence_penalty = 0.3;
    r.sampling.repetition_penalty = 1.3;
    r.sampling.logit_bias = {{g.greedy[3], -2.0f}, {86, 0.5f}};
    reqs.push_back(r);
  }
  const EngineOptions plain{.max_seqs = 8, .max_step_tokens = 96, .prefill_chunk = 32};
  auto want = RunAll(&local, plain, reqs);
  size_t differs = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& g = t->goldens[i].greedy;
    differs += want[i][0].tokens != std::vector<int32_t>(g.begin(), g.begin() + 20) ? 1 : 0;
  }
  EXPECT_GT(differs, 0u) << "the penalties changed nothing: the comparison below would be vacuous";
  for (SpecMethod spec : {SpecMethod::kNgram, SpecMethod::kDspark}) {
    for (int64_t depth : {1, 3, 5}) {
      EngineOptions o = plain;
      o.spec = SpecConfig{.method = spec, .depth = depth};
      auto got = RunAll(&local, o, reqs);
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_EQ(got[i][0].tokens, want[i][0].tokens) << SpecMethodName(spec) << " depth " << depth << " request " << i;
        for (size_t k = 0; k < got[i][0].logprobs.size(); ++k) {
          EXPECT_NEAR(got[i][0].logprobs[k].chosen.logprob, want[i][0].logprobs[k].chosen.logprob, 1e-4);
        }
      }
    }
  }
}

TEST(SamplingEngine, ExtrasCrossTheChannelWithTheInProcessResults) {
  test::TinyModel* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  auto gpu_model = cpu::CpuModel::Create(*t->ckpt, nullptr);
  ASSERT_OK(gpu_model);
  gpu::ModelHost host;
  host.model = gpu_model->get();
  const ModelConfig& cfg = t->ckpt->config();
  shm::Geometry geo{.hidden = static_cast<uint32_t>(cfg.hidden_size),
                    .top_k = static_cast<uint32_t>(cfg.num_experts_per_tok),
                    .max_rows = 64,
                    .max_seqs = 8,
                    .vocab = static_cast<uint32_t>(cfg.vocab_size),
                    .fork = 1};
  auto gpu_end = shm::Channel::CreateAnonymous(geo);
  ASSERT_OK(gpu_end);
  auto worker_end = (*gpu_end)->PeerEndpoint();
  ASSERT_OK(worker_end);
  gpu::WorkerSession session(&host, gpu::SessionInfo{.lease = 1, .worker_id = "test"}, std::move(*gpu_end));
  session.Start(nullptr);
  RemoteExecutor remote(worker_end->get(), t->experts.get());
  ASSERT_TRUE(remote.limits().model.fork);

  std::vector<EngineRequest> reqs;
  EngineRequest a = Greedy(t->goldens[0], 12, 20);  // forked choices with log-probs and penalties
  a.n = 3;
  a.sampling.temperature = 0.8;
  a.sampling.seed = 99;
  a.sampling.frequency_penalty = 0.5;
  a.sampling.min_p = 0.05;
  reqs.push_back(a);
  EngineRequest b = Greedy(t->goldens[3], 6);  // a logit bias that forces a token
  b.sampling.logit_bias = {{77, 100.0f}};
  reqs.push_back(b);
  EngineRequest c = Greedy(t->goldens[1], 8, 0);  // chosen log-probs only, repetition penalty
  c.sampling.repetition_penalty = 1.5;
  reqs.push_back(c);

  const EngineOptions o{.max_seqs = 8, .max_step_tokens = 64, .prefill_chunk = 32};
  LocalExecutor local(t->model.get(), t->experts.get());
  auto want = RunAll(&local, o, reqs);
  ForkCounter counted(&remote, true);
  EngineStats stats;
  auto got = RunAll(&counted, o, reqs, &stats);
  EXPECT_EQ(counted.forks, 2);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i].size(), want[i].size()) << i;
    for (size_t k = 0; k < got[i].size(); ++k) {
      EXPECT_EQ(got[i][k].tokens, want[i][k].tokens) << "request " << i << " choice " << k;
      ASSERT_EQ(got[i][k].logprobs.size(), want[i][k].logprobs.size()) << "request " << i << " choice " << k;
      for (size_t s = 0; s < got[i][k].logprobs.size(); ++s) {
        const EmittedLogprobs &x = got[i][k].logprobs[s], &y = want[i][k].logprobs[s];
        EXPECT_EQ(x.chosen.token, y.chosen.token);
        EXPECT_NEAR(x.chosen.logprob, y.chosen.logprob, 1e-5);
        ASSERT_EQ(x.top.size(), y.top.size());
        for (size_t j = 0; j < x.top.size(); ++j) EXPECT_EQ(x.top[j].token, y.top[j].token);
      }
    }
  }
  EXPECT_EQ(got[1][0].tokens, std::vector<int32_t>(6, 77));
  EXPECT_EQ(got[0][0].logprobs[0].top.size(), 20u);
  EXPECT_TRUE(got[2][0].logprobs[0].top.empty());
  EXPECT_TRUE(got[1][0].logprobs.empty());
  EXPECT_EQ(session.sequences(), 0);

  // A bad logit bias is refused on both ends, naming the field.
  auto bad = remote.Open(SamplingParams{.logit_bias = {{5000, 1.0f}}});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("logit_bias"), std::string::npos) << bad.status();
  session.Stop();
}

}  // namespace
}  // namespace numoe::engine
