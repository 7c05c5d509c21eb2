// Speculative decoding in the worker's engine (LocalExecutor over tiny-v4 with its DSpark stages, and a
// scripted executor for exact control of what is accepted):
//   - greedy with speculation emits exactly the fixture's greedy tokens for depths 1-7 and batches of 1-8,
//     with the n-gram drafter (p2's continuation repeats, so drafts are accepted) and DSpark (random
//     stages: almost nothing is accepted, which exercises rollback), fixed and adaptive depth;
//   - a budget matrix (max_seqs x depth x max_step_tokens) finishes every request with those tokens and
//     never exceeds the step budget;
//   - a stop id / EOS inside an accepted run ends the request there (the rest is dropped, the kept tokens
//     arrive in one OnTokens call); drafts never run past max_new_tokens or the context limit;
//   - with temperature > 0 the engine's tokens equal GenerateBatch's with the same speculation;
//   - the MTP drafter (a synthetic tiny checkpoint with one random mtp.0 block): speculative greedy equals
//     the engine's plain greedy, and sampled equals GenerateBatch's;
//   - the same greedy equality through RemoteExecutor -> shared-memory channel -> a gpu WorkerSession that
//     verifies (the worker's real data path), with both drafters;
//   - CheckSpec and LocalExecutor refuse bad settings and items with clear errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "common/shm_channel.h"
#include "model/generation.h"
#include "gpu_service/session.h"
#include "tests/support/fixtures.h"
#include "worker/engine/engine.h"
#include "worker/engine/local_executor.h"
#include "worker/engine/remote_executor.h"
#include "worker/engine/stream.h"
#include "tests/support/status_matchers.h"

namespace numoe::engine {
namespace {

// tiny-v4 with its DSpark drafter and goldens (the shared tests/support fixture).
using Tiny = test::TinyModel;
Tiny* LoadTiny() {
  auto tiny = test::TinyModel::Get({.drafter = true});
  if (!tiny.ok()) ADD_FAILURE() << tiny.status();
  return tiny.ok() ? *tiny : nullptr;
}

// Wraps an executor: checks every step against the engine's budget and records what drafts it carried.
class Recorder final : public Executor {
 public:
  Recorder(Executor* inner, int64_t budget) : inner_(inner), budget_(budget) {}
  StatusOr<ExecSeq> Open(const SamplingParams& s) override {
    auto r = inner_->Open(s);
    if (r.ok()) max_open = std::max(max_open, ++open);
    return r;
  }
  Status Close(ExecSeq seq) override {
    --open;
    return inner_->Close(seq);
  }
  Status Step(std::span<const StepItem> items, StepOutput* out) override {
    int64_t rows = 0;
    for (const StepItem& it : items) {
      rows += it.rows();
      largest_drafts = std::max<int64_t>(largest_drafts, it.drafts + it.model_drafts);
      if (it.model_drafts > 0) model_drafts.push_back(it.model_drafts);
    }
    EXPECT_LE(rows, budget_) << "a step exceeded max_step_tokens";
    ++steps;
    Status st = inner_->Step(items, out);
    if (st.ok()) {
      for (size_t i = 0; i < items.size(); ++i) {
        if (out->counts[i] > 1) ++multi_token_items;
      }
    }
    return st;
  }
  Status Flush() override { return inner_->Flush(); }
  ExecutorLimits limits() const override { return inner_->limits(); }

  Executor* inner_;
  int64_t budget_;
  int64_t open = 0, max_open = 0, steps = 0, largest_drafts = 0, multi_token_items = 0;
  std::vector<int64_t> model_drafts;  // every model_drafts > 0 asked for, in order
};

// Drives the engine on this thread until every request has ended.
void RunToEnd(Engine& engine, int max_steps = 20000) {
  for (int i = 0; i < max_steps; ++i) {
    if (!engine.StepOnce() && engine.stats().active == 0 && engine.stats().queued == 0) return;
  }
  ADD_FAILURE() << "engine did not finish within " << max_steps << " steps";
}

// Request i of a batch: p2 (1 token, its greedy continuation repeats "330 307") and p0 (37 tokens)
// alternately, greedy, EOS ignored.
EngineRequest BatchRequest(const Tiny& t, size_t i, int64_t new_tokens) {
  const test::GoldenPrompt& g = t.goldens[i % 2 == 0 ? 2 : 0];
  EngineRequest r;
  r.prompt = g.input_ids;
  r.max_new_tokens = new_tokens;
  r.ignore_eos = true;
  r.request_id = g.name + "#" + std::to_string(i);
  return r;
}

std::vector<int32_t> Golden(const Tiny& t, size_t i, int64_t new_tokens) {
  const auto& g = t.goldens[i % 2 == 0 ? 2 : 0].greedy;
  return std::vector<int32_t>(g.begin(), g.begin() + new_tokens);
}

struct RunResult {
  std::vector<StatusOr<RequestStream::Result>> results;
  EngineStats stats;
};

RunResult RunBatch(Executor* ex, const EngineOptions& o, const Tiny& t, size_t batch, int64_t new_tokens) {
  Engine engine(ex, o);
  std::vector<std::unique_ptr<RequestStream>> streams;
  for (size_t i = 0; i < batch; ++i) {
    auto s = RequestStream::Open(&engine, BatchRequest(t, i, new_tokens));
    EXPECT_OK(s);
    if (s.ok()) streams.push_back(std::move(*s));
  }
  RunToEnd(engine);
  RunResult out;
  for (auto& s : streams) out.results.push_back(s->Wait());
  out.stats = engine.stats();
  return out;
}

class GreedySpec : public ::testing::TestWithParam<SpecMethod> {};

TEST_P(GreedySpec, EqualsPlainGreedyForEveryDepthAndBatch) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const SpecMethod method = GetParam();
  const int64_t kNew = 12;
  LocalExecutor local(t->model.get(), t->experts.get());
  int64_t drafted = 0, accepted = 0, verify_steps = 0, multi = 0;
  for (int64_t depth = 1; depth <= 7; ++depth) {
    for (size_t batch = 1; batch <= 8; ++batch) {
      Recorder rec(&local, 64);
      EngineOptions o{.max_seqs = 8, .max_step_tokens = 64, .prefill_chunk = 16};
      o.spec = SpecConfig{.method = method, .depth = depth};
      RunResult r = RunBatch(&rec, o, *t, batch, kNew);
      ASSERT_EQ(r.results.size(), batch);
      for (size_t i = 0; i < batch; ++i) {
        ASSERT_OK(r.results[i]);
        EXPECT_EQ(r.results[i]->tokens, Golden(*t, i, kNew))
            << SpecMethodName(method) << " depth " << depth << " batch " << batch << " request " << i;
        EXPECT_EQ(r.results[i]->finish_reason, "length");
      }
      EXPECT_EQ(r.stats.spec_method, method);
      EXPECT_EQ(r.stats.tokens_generated, static_cast<int64_t>(batch) * kNew);
      EXPECT_LE(rec.largest_drafts, depth);
      EXPECT_EQ(rec.open, 0);
      EXPECT_EQ(local.open_sequences(), 0);
      drafted += r.stats.spec_drafted;
      accepted += r.stats.spec_accepted;
      verify_steps += r.stats.spec_verify_steps;
      multi += rec.multi_token_items;
    }
  }
  EXPECT_GT(verify_steps, 0);
  EXPECT_GT(drafted, 0);
  EXPECT_LE(accepted, drafted);
  if (method == SpecMethod::kNgram) {
    // p2 repeats "330 307": the n-gram drafter finds it and the target agrees.
    EXPECT_GT(accepted, 0);
    EXPECT_GT(multi, 0) << "no step emitted more than one token";
  }
  std::printf("[ spec ] %s: %lld verify steps, %lld drafted, %lld accepted\n", SpecMethodName(method),
              static_cast<long long>(verify_steps), static_cast<long long>(drafted),
              static_cast<long long>(accepted));
}

INSTANTIATE_TEST_SUITE_P(Drafters, GreedySpec, ::testing::Values(SpecMethod::kNgram, SpecMethod::kDspark),
                         [](const auto& info) { return std::string(SpecMethodName(info.param)); });

TEST(SpecEngine, AdaptiveDepthShrinksWhenNothingIsAcceptedAndKeepsTheTokens) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const int64_t kNew = 20;
  LocalExecutor local(t->model.get(), t->experts.get());
  for (SpecMethod method : {SpecMethod::kDspark, SpecMethod::kNgram}) {
    double per_step[2] = {0, 0};
    for (bool adaptive : {false, true}) {
      Recorder rec(&local, 64);
      EngineOptions o{.max_seqs = 4, .max_step_tokens = 64};
      o.spec = SpecConfig{.method = method, .depth = 7, .adaptive = adaptive};
      RunResult r = RunBatch(&rec, o, *t, 4, kNew);
      for (size_t i = 0; i < 4; ++i) {
        ASSERT_OK(r.results[i]);
        EXPECT_EQ(r.results[i]->tokens, Golden(*t, i, kNew)) << SpecMethodName(method) << " adaptive " << adaptive;
      }
      ASSERT_GT(r.stats.spec_verify_steps, 0);
      per_step[adaptive] = static_cast<double>(r.stats.spec_drafted) / static_cast<double>(r.stats.spec_verify_steps);
      if (method == SpecMethod::kDspark && adaptive) {
        // Random stages keep (almost) nothing: every sequence walks down from 7 to 1.
        ASSERT_FALSE(rec.model_drafts.empty());
        EXPECT_EQ(rec.model_drafts.front(), 7);
        EXPECT_EQ(*std::min_element(rec.model_drafts.begin(), rec.model_drafts.end()), 1);
      }
    }
    if (method == SpecMethod::kDspark) {
      EXPECT_GT(per_step[0], 5.0) << "fixed depth 7 drafts up to 7 per verify step";
      EXPECT_LT(per_step[1], 3.0) << "adaptive depth should have dropped towards 1";
    }
  }
}

// Every max_seqs x depth x max_step_tokens combination of the grid finishes every request with the
// plain-greedy tokens and keeps within the budget (a budget of 1 leaves no room for drafts at all).
TEST(SpecEngine, BudgetMatrixFinishesEveryRequest) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  const int64_t kNew = 10;  // p2's repeat ("330 307 330" at 3..5) gives the n-gram drafter work from token 6
  LocalExecutor local(t->model.get(), t->experts.get());
  int combo = 0;
  for (int64_t max_seqs : {1, 2, 4, 8}) {
    for (int64_t depth : {1, 3, 7}) {
      for (int64_t budget : {1, 4, 32}) {
        const SpecMethod method = combo++ % 2 == 0 ? SpecMethod::kNgram : SpecMethod::kDspark;
        Recorder rec(&local, budget);
        EngineOptions o{.max_seqs = max_seqs, .max_step_tokens = budget, .prefill_chunk = 0};
        o.spec = SpecConfig{.method = method, .depth = depth};
        // Short prompts (p2, 1 token) keep a budget of 1 quick; one p0 brings a 37-token prefill.
        const size_t batch = std::max<size_t>(static_cast<size_t>(max_seqs) + 1, 3);
        Engine engine(&rec, o);
        std::vector<std::unique_ptr<RequestStream>> streams;
        for (size_t i = 0; i < batch; ++i) {
          auto s = RequestStream::Open(&engine, BatchRequest(*t, i == 1 ? 1 : 0, kNew));
          ASSERT_OK(s);
          streams.push_back(std::move(*s));
        }
        RunToEnd(engine);
        const std::string where = absl::StrCat(SpecMethodName(method), " max_seqs ", max_seqs, " depth ", depth,
                                               " max_step_tokens ", budget);
        for (size_t i = 0; i < batch; ++i) {
          auto r = streams[i]->Wait();
          ASSERT_OK(r) << where << ": " << r.status();
          EXPECT_EQ(r->tokens, Golden(*t, i == 1 ? 1 : 0, kNew)) << where << " request " << i;
        }
        EXPECT_LE(rec.max_open, max_seqs) << where;
        EXPECT_LE(rec.largest_drafts, std::min(depth, budget - 1)) << where;
        if (budget == 32) {
          EXPECT_GT(engine.stats().spec_drafted, 0) << where;
          if (method == SpecMethod::kNgram) {
            EXPECT_GT(engine.stats().spec_accepted, 0) << where;
          }
        }
        EXPECT_EQ(local.open_sequences(), 0) << where;
      }
    }
  }
}

// Samples with temperature: the engine's speculative tokens equal GenerateBatch's with the same spec
// (the same drafts, the same verification, the same per-sequence RNG draws).
TEST(SpecEngine, SampledTokensEqualGenerateBatchWithTheSameSpec) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  for (SpecMethod method : {SpecMethod::kNgram, SpecMethod::kDspark}) {
    const SpecConfig spec{.method = method, .depth = 3};
    std::vector<GenerateRequest> batch;
    std::vector<std::unique_ptr<RequestStream>> streams;
    LocalExecutor local(t->model.get(), t->experts.get());
    EngineOptions o{.max_step_tokens = 256, .prefill_chunk = 0};
    o.spec = spec;
    Engine engine(&local, o);
    for (size_t i = 0; i < 4; ++i) {
      EngineRequest r = BatchRequest(*t, i, 10);
      r.sampling = SamplingParams{.temperature = 0.8, .top_p = 0.95, .top_k = 40, .seed = 77 + i};
      GenerateRequest g;
      g.prompt = r.prompt;
      g.max_new_tokens = r.max_new_tokens;
      g.ignore_eos = true;
      g.sampling = r.sampling;
      batch.push_back(g);
      auto s = RequestStream::Open(&engine, r);
      ASSERT_OK(s);
      streams.push_back(std::move(*s));
    }
    RunToEnd(engine);
    auto expected = GenerateBatch(*t->model, *t->experts, batch, nullptr, spec);
    ASSERT_OK(expected);
    for (size_t i = 0; i < streams.size(); ++i) {
      auto r = streams[i]->Wait();
      ASSERT_OK(r);
      EXPECT_EQ(r->tokens, (*expected)[i].tokens) << SpecMethodName(method) << " request " << i;
    }
    EXPECT_GT(engine.stats().spec_verify_steps, 0);
  }
}

// The synthetic tiny checkpoint with one MTP block and its drafter (the shared tests/support fixture).
using Mtp = test::TinyModel;
Mtp* LoadMtp() {
  auto m = test::TinyModel::Get({.model = test::kTinyMtp, .drafter = true});
  if (!m.ok()) ADD_FAILURE() << m.status();
  return m.ok() ? *m : nullptr;
}

TEST(SpecEngine, MtpDrafterEqualsPlainGreedyAndSampledEqualsGenerateBatch) {
  Mtp* m = LoadMtp();
  ASSERT_NE(m, nullptr);
  ASSERT_EQ(m->model->drafter(), SpecMethod::kMtp);
  const int64_t V = m->ckpt->config().vocab_size;
  LocalExecutor local(m->model.get(), m->experts.get());
  EXPECT_EQ(local.limits().drafter(), SpecMethod::kMtp);
  EXPECT_OK(CheckSpec(SpecConfig{.method = SpecMethod::kMtp, .depth = 7}, local.limits()));
  EXPECT_EQ(CheckSpec(SpecConfig{.method = SpecMethod::kDspark}, local.limits()).code(),
            absl::StatusCode::kFailedPrecondition);
  auto requests = [&](size_t n, bool sampled) {
    std::vector<EngineRequest> out;
    for (size_t i = 0; i < n; ++i) {
      EngineRequest r;
      for (size_t k = 0; k < 3 + (i * 5) % 11; ++k) r.prompt.push_back(static_cast<int32_t>((k * 37 + i * 11 + 3) % V));
      r.max_new_tokens = 10;
      r.ignore_eos = true;
      if (sampled) r.sampling = SamplingParams{.temperature = 0.7, .top_p = 0.9, .seed = 300 + i};
      out.push_back(r);
    }
    return out;
  };
  auto run = [&](const EngineOptions& o, const std::vector<EngineRequest>& reqs, EngineStats* stats) {
    Engine engine(&local, o);
    std::vector<std::unique_ptr<RequestStream>> streams;
    for (const auto& r : reqs) {
      auto s = RequestStream::Open(&engine, r);
      EXPECT_OK(s);
      if (s.ok()) streams.push_back(std::move(*s));
    }
    RunToEnd(engine);
    std::vector<std::vector<int32_t>> out;
    for (auto& s : streams) {
      auto r = s->Wait();
      EXPECT_OK(r);
      out.push_back(r.ok() ? r->tokens : std::vector<int32_t>{});
    }
    if (stats != nullptr) *stats = engine.stats();
    return out;
  };
  for (size_t batch : {1, 3, 8}) {
    const auto reqs = requests(batch, false);
    const auto plain = run(EngineOptions{.max_step_tokens = 256}, reqs, nullptr);
    for (int64_t depth : {1, 3, 7}) {
      EngineOptions o{.max_step_tokens = 256};
      o.spec = SpecConfig{.method = SpecMethod::kMtp, .depth = depth, .adaptive = depth == 3};
      EngineStats st;
      EXPECT_EQ(run(o, reqs, &st), plain) << "batch " << batch << " depth " << depth;
      EXPECT_EQ(st.spec_method, SpecMethod::kMtp);
      EXPECT_GT(st.spec_drafted, 0);
    }
  }
  // Sampled: the same drafts, verification and RNG draws as GenerateBatch with the same spec.
  const auto reqs = requests(4, true);
  const SpecConfig spec{.method = SpecMethod::kMtp, .depth = 3};
  EngineOptions o{.max_step_tokens = 256};
  o.spec = spec;
  std::vector<GenerateRequest> batch;
  for (const auto& r : reqs) {
    GenerateRequest g;
    g.prompt = r.prompt;
    g.max_new_tokens = r.max_new_tokens;
    g.ignore_eos = true;
    g.sampling = r.sampling;
    batch.push_back(g);
  }
  auto expected = GenerateBatch(*m->model, *m->experts, batch, nullptr, spec);
  ASSERT_OK(expected);
  const auto got = run(o, reqs, nullptr);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i], (*expected)[i].tokens) << i;
}

// The worker's data path: engine -> RemoteExecutor -> channel -> gpu WorkerSession (CpuModel with its
// DSpark drafter) whose MoE comes back over the channel to ReferenceExperts.
TEST(SpecEngine, RemoteExecutorOverTheChannelEqualsPlainGreedy) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  gpu::ModelHost host;
  host.model = t->model.get();
  const ModelConfig& cfg = t->ckpt->config();
  shm::Geometry geo{.hidden = static_cast<uint32_t>(cfg.hidden_size),
                    .top_k = static_cast<uint32_t>(cfg.num_experts_per_tok),
                    .max_rows = 48,
                    .max_seqs = 4,
                    .vocab = static_cast<uint32_t>(cfg.vocab_size),
                    .logits_rows = 0,
                    .drafter = SpecMethod::kDspark,
                    .max_model_drafts = 16,
                    .verify = 1};
  auto gpu_end = shm::Channel::CreateAnonymous(geo);
  ASSERT_OK(gpu_end);
  auto worker_end = (*gpu_end)->PeerEndpoint();
  ASSERT_OK(worker_end);
  gpu::WorkerSession session(&host, gpu::SessionInfo{.lease = 1, .worker_id = "spec-engine"}, std::move(*gpu_end));
  session.Start(nullptr);
  RemoteExecutor remote(worker_end->get(), t->experts.get());
  ASSERT_OK(CheckSpec(SpecConfig{.method = SpecMethod::kDspark, .depth = 7}, remote.limits()));
  const int64_t kNew = 12;
  for (SpecMethod method : {SpecMethod::kNgram, SpecMethod::kDspark}) {
    for (int64_t depth : {2, 7}) {
      Recorder rec(&remote, 48);
      EngineOptions o{.max_seqs = 8, .max_step_tokens = 1000, .prefill_chunk = 16};
      o.spec = SpecConfig{.method = method, .depth = depth, .adaptive = depth == 7};
      RunResult r = RunBatch(&rec, o, *t, 6, kNew);
      for (size_t i = 0; i < r.results.size(); ++i) {
        ASSERT_OK(r.results[i]);
        EXPECT_EQ(r.results[i]->tokens, Golden(*t, i, kNew)) << SpecMethodName(method) << " depth " << depth << " " << i;
      }
      EXPECT_EQ(r.stats.spec_method, method);
      EXPECT_GT(r.stats.spec_drafted, 0) << SpecMethodName(method);
      if (method == SpecMethod::kNgram) {
        EXPECT_GT(r.stats.spec_accepted, 0);
      }
      EXPECT_LE(rec.max_open, 4);  // clamped to the channel
    }
  }
  ASSERT_OK(remote.Flush());
  EXPECT_EQ(session.sequences(), 0);
  session.Stop();
}

// ---- A scripted executor: the "target" continues each sequence with a fixed script; the model drafter
// proposes the script itself (so every model draft is accepted); n-gram drafts are checked against it.
class ScriptedExecutor final : public Executor {
 public:
  explicit ScriptedExecutor(std::vector<int32_t> script) : script_(std::move(script)) {}
  StatusOr<ExecSeq> Open(const SamplingParams&) override {
    emitted_[next_] = 0;
    return next_++;
  }
  Status Close(ExecSeq seq) override {
    emitted_.erase(seq);
    return absl::OkStatus();
  }
  Status Step(std::span<const StepItem> items, StepOutput* out) override {
    out->Reset(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const StepItem& it = items[i];
      if (!it.sample) continue;
      size_t& p = emitted_.at(it.seq);
      std::vector<int32_t> drafts(it.tokens.end() - it.drafts, it.tokens.end());
      for (int32_t j = 0; j < it.model_drafts; ++j) drafts.push_back(script_.at(p + j));
      size_t a = 0;
      while (a < drafts.size() && drafts[a] == script_.at(p + a)) ++a;
      const int32_t count = static_cast<int32_t>(a + 1) + extra_count;
      out->tokens[i] = script_.at(p);
      out->counts[i] = count;
      out->drafted[i] = static_cast<int32_t>(drafts.size());
      out->accepted[i] = static_cast<int32_t>(a);
      for (int32_t j = 0; j < count; ++j) out->emitted.push_back(script_.at(p + j));
      p += static_cast<size_t>(count);
      model_drafts_asked.push_back(it.model_drafts);
    }
    return absl::OkStatus();
  }
  ExecutorLimits limits() const override {
    return ExecutorLimits{.vocab_size = 1024,
                          .model = {.verify = true, .drafter = SpecMethod::kDspark, .max_spec_tokens = 17}};
  }

  int32_t extra_count = 0;  // > 0: a broken executor that claims more tokens than it could emit
  std::vector<int32_t> model_drafts_asked;

 private:
  std::vector<int32_t> script_;
  std::map<ExecSeq, size_t> emitted_;
  ExecSeq next_ = 1;
};

// Records every OnTokens call.
class CallSink final : public TokenSink {
 public:
  void OnTokens(int32_t, std::span<const int32_t> tokens, std::span<const EmittedLogprobs>,
                std::string_view finish_reason) override {
    calls.emplace_back(tokens.begin(), tokens.end());
    reason = finish_reason;
  }
  void OnError(const Status& status) override { error = status; }
  std::vector<std::vector<int32_t>> calls;
  std::string reason;
  Status error;
};

struct ScriptRun {
  std::shared_ptr<CallSink> sink = std::make_shared<CallSink>();
  EngineStats stats;
};

ScriptRun RunScript(ScriptedExecutor* ex, EngineOptions o, EngineRequest r) {
  ScriptRun run;
  Engine engine(ex, o);
  auto id = engine.Submit(std::move(r), run.sink);
  EXPECT_OK(id);
  RunToEnd(engine, 1000);
  run.stats = engine.stats();
  return run;
}

std::vector<int32_t> Counting(int32_t from, int32_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + i;
  return v;
}

EngineRequest ScriptRequest(int64_t max_new_tokens) {
  EngineRequest r;
  r.prompt = {1, 2, 3};
  r.max_new_tokens = max_new_tokens;
  r.ignore_eos = true;
  return r;
}

TEST(SpecEngine, StopInsideAnAcceptedRunDropsTheRest) {
  using V = std::vector<std::vector<int32_t>>;
  EngineOptions o{.max_step_tokens = 64, .eos_token_id = 1000};
  o.spec = SpecConfig{.method = SpecMethod::kDspark, .depth = 7};

  {  // A stop id in the middle of 7 accepted drafts: 11, 12, 13 kept, 14..18 dropped.
    ScriptedExecutor ex(Counting(10, 64));
    EngineRequest r = ScriptRequest(20);
    r.stop_token_ids = {13};
    ScriptRun run = RunScript(&ex, o, r);
    EXPECT_EQ(run.sink->calls, (V{{10}, {11, 12, 13}}));
    EXPECT_EQ(run.sink->reason, "stop");
    EXPECT_EQ(run.stats.tokens_generated, 4);
    EXPECT_EQ(run.stats.spec_verify_steps, 1);
    EXPECT_EQ(run.stats.spec_drafted, 7);
    EXPECT_EQ(run.stats.spec_accepted, 7);
    EXPECT_EQ(run.stats.active, 0);
  }
  {  // EOS in the middle (not ignored).
    ScriptedExecutor ex(Counting(10, 64));
    EngineOptions eo = o;
    eo.eos_token_id = 12;
    EngineRequest r = ScriptRequest(20);
    r.ignore_eos = false;
    ScriptRun run = RunScript(&ex, eo, r);
    EXPECT_EQ(run.sink->calls, (V{{10}, {11, 12}}));
    EXPECT_EQ(run.sink->reason, "stop");
  }
  {  // max_new_tokens: drafts are capped so the step ends exactly there (1 + 3 tokens after the first).
    ScriptedExecutor ex(Counting(10, 64));
    ScriptRun run = RunScript(&ex, o, ScriptRequest(5));
    EXPECT_EQ(run.sink->calls, (V{{10}, {11, 12, 13, 14}}));
    EXPECT_EQ(run.sink->reason, "length");
    EXPECT_EQ(ex.model_drafts_asked, (std::vector<int32_t>{0, 3}));
  }
  {  // The context limit: 3 prompt tokens + 1 generated leave room for 2 more at max_context 6.
    ScriptedExecutor ex(Counting(10, 64));
    EngineOptions co = o;
    co.max_context = 6;
    ScriptRun run = RunScript(&ex, co, ScriptRequest(20));
    EXPECT_EQ(run.sink->calls, (V{{10}, {11, 12}}));
    EXPECT_EQ(run.sink->reason, "length");
    EXPECT_EQ(ex.model_drafts_asked, (std::vector<int32_t>{0, 1}));
  }
  {  // N-gram drafts from the worker: prompt "10 11 12" and a script that repeats it, then 99.
    ScriptedExecutor ex({10, 11, 12, 10, 11, 12, 10, 99, 98, 97, 96, 95, 94, 93, 92, 91});
    EngineOptions no = o;
    no.spec = SpecConfig{.method = SpecMethod::kNgram, .depth = 7};
    EngineRequest r = ScriptRequest(12);
    r.prompt = {10, 11, 12};
    r.stop_token_ids = {12};
    ScriptRun run = RunScript(&ex, no, r);
    // Step 2 drafts "11 12 10" (what followed the earlier "10"): 11 and 12 are emitted, 12 stops.
    EXPECT_EQ(run.sink->calls, (V{{10}, {11, 12}}));
    EXPECT_EQ(run.sink->reason, "stop");
    EXPECT_EQ(run.stats.spec_drafted, 3);
    EXPECT_EQ(run.stats.spec_accepted, 3);
  }
  {  // A broken executor (claims more tokens than rows): the request fails, nothing crashes.
    ScriptedExecutor ex(Counting(10, 64));
    ex.extra_count = 20;
    ScriptRun run = RunScript(&ex, o, ScriptRequest(20));
    EXPECT_EQ(run.sink->error.code(), absl::StatusCode::kInternal) << run.sink->error;
    EXPECT_NE(run.sink->error.message().find("inconsistent"), std::string::npos) << run.sink->error;
  }
}

TEST(SpecEngine, CheckSpecSaysWhatToChange) {
  // Executors that verify drafts: one without a model drafter, one with DSpark and 8 drafts per step.
  const ExecutorLimits none{.vocab_size = 1024, .model = {.verify = true}};
  const ExecutorLimits dspark{.vocab_size = 1024,
                              .model = {.verify = true, .drafter = SpecMethod::kDspark, .max_spec_tokens = 9}};
  EXPECT_OK(CheckSpec(SpecConfig{}, none));
  EXPECT_OK(CheckSpec(SpecConfig{.method = SpecMethod::kNgram, .depth = 16}, none));
  EXPECT_OK(CheckSpec(SpecConfig{.method = SpecMethod::kDspark, .depth = 5}, dspark));

  Status st = CheckSpec(SpecConfig{.method = SpecMethod::kDspark}, none);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(),
            "--spec dspark: numoe-gpu drafts with none; start numoe-gpu with --spec dspark (or this worker with "
            "--spec ngram or none)");
  st = CheckSpec(SpecConfig{.method = SpecMethod::kMtp}, dspark);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("--spec mtp"), std::string::npos) << st;
  EXPECT_NE(st.message().find("dspark"), std::string::npos) << st;
  st = CheckSpec(SpecConfig{.method = SpecMethod::kNgram, .depth = 0}, none);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("depth"), std::string::npos) << st;
  st = CheckSpec(SpecConfig{.method = SpecMethod::kNgram, .depth = 17}, none);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  st = CheckSpec(SpecConfig{.method = SpecMethod::kNgram, .ngram_max = 1, .ngram_min = 2}, none);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  st = CheckSpec(SpecConfig{.method = SpecMethod::kDspark, .depth = 9}, dspark);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--spec-depth 9"), std::string::npos) << st;
  EXPECT_EQ(ValidateEngineOptions(EngineOptions{.spec = SpecConfig{.method = SpecMethod::kNgram, .depth = 0}}).code(),
            absl::StatusCode::kInvalidArgument);

  // The executors report their drafter: tiny-v4 loaded with its DSpark stages, and without.
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor with(t->model.get(), t->experts.get());
  EXPECT_EQ(with.limits().drafter(), SpecMethod::kDspark);
  EXPECT_EQ(with.limits().max_model_drafts(), 16);
  EXPECT_OK(CheckSpec(SpecConfig{.method = SpecMethod::kDspark, .depth = 7}, with.limits()));
  auto plain = cpu::CpuModel::Create(*t->ckpt, nullptr);
  ASSERT_OK(plain);
  LocalExecutor without(plain->get(), t->experts.get());
  EXPECT_EQ(without.limits().drafter(), SpecMethod::kNone);
  EXPECT_EQ(without.limits().max_model_drafts(), 0);
  EXPECT_EQ(CheckSpec(SpecConfig{.method = SpecMethod::kDspark}, without.limits()).code(),
            absl::StatusCode::kFailedPrecondition);
  // An engine given a spec its executor cannot serve runs without speculation (and stays correct).
  EngineOptions o{.max_step_tokens = 64};
  o.spec = SpecConfig{.method = SpecMethod::kDspark, .depth = 4};
  RunResult r = RunBatch(&without, o, *t, 2, 6);
  EXPECT_EQ(r.stats.spec_method, SpecMethod::kNone);
  EXPECT_EQ(r.stats.spec_drafted, 0);
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_OK(r.results[i]);
    EXPECT_EQ(r.results[i]->tokens, Golden(*t, i, 6));
  }
}

TEST(SpecEngine, LocalExecutorRefusesBadSpeculativeItems) {
  Tiny* t = LoadTiny();
  ASSERT_NE(t, nullptr);
  LocalExecutor local(t->model.get(), t->experts.get());
  auto seq = local.Open(SamplingParams{});
  ASSERT_OK(seq);
  const std::vector<int32_t> two = {5, 6};
  const int32_t one = 5;
  StepOutput out;
  auto expect = [&](StepItem item, absl::StatusCode code, const std::string& needle) {
    Status st = local.Step(std::span<const StepItem>(&item, 1), &out);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
  };
  expect(StepItem{.seq = *seq, .tokens = two, .drafts = 1}, absl::StatusCode::kInvalidArgument, "need sample");
  expect(StepItem{.seq = *seq, .tokens = two, .sample = true, .drafts = 2}, absl::StatusCode::kInvalidArgument,
         "needs at least 3 tokens");
  expect(StepItem{.seq = *seq, .tokens = two, .sample = true, .model_drafts = 2},
         absl::StatusCode::kInvalidArgument, "exactly 1 token");
  expect(StepItem{.seq = *seq, .tokens = two, .sample = true, .logits = true, .drafts = 1},
         absl::StatusCode::kInvalidArgument, "logits");
  expect(StepItem{.seq = *seq, .tokens = {&one, 1}, .sample = true, .model_drafts = 17},
         absl::StatusCode::kInvalidArgument, "limit of 16");
  expect(StepItem{.seq = *seq, .tokens = {&one, 1}, .sample = true, .drafts = -1},
         absl::StatusCode::kInvalidArgument, ">= 0");
  ASSERT_OK(local.Close(*seq));

  auto plain = cpu::CpuModel::Create(*t->ckpt, nullptr);
  ASSERT_OK(plain);
  LocalExecutor without(plain->get(), t->experts.get());
  auto s2 = without.Open(SamplingParams{});
  ASSERT_OK(s2);
  StepItem item{.seq = *s2, .tokens = {&one, 1}, .sample = true, .model_drafts = 2};
  Status st = without.Step(std::span<const StepItem>(&item, 1), &out);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("no drafter"), std::string::npos) << st;

  // A good speculative step after a prefill: counts, drafted and accepted are consistent.
  const auto& p = t->goldens[2];  // prompt [0], greedy 636 86 414 ...
  StepItem pre{.seq = *s2, .tokens = p.input_ids, .sample = true};
  ASSERT_OK(without.Step(std::span<const StepItem>(&pre, 1), &out));
  ASSERT_EQ(out.tokens[0], p.greedy[0]);
  // Drafts: the true continuation 86, then a wrong token: 86 kept, then the target's 414.
  const std::vector<int32_t> feed = {p.greedy[0], p.greedy[1], (p.greedy[2] + 1) % 1024};
  StepItem spec{.seq = *s2, .tokens = feed, .sample = true, .drafts = 2};
  ASSERT_OK(without.Step(std::span<const StepItem>(&spec, 1), &out));
  EXPECT_EQ(out.counts, std::vector<int32_t>{2});
  EXPECT_EQ(out.drafted, std::vector<int32_t>{2});
  EXPECT_EQ(out.accepted, std::vector<int32_t>{1});
  EXPECT_EQ(out.emitted, (std::vector<int32_t>{p.greedy[1], p.greedy[2]}));
  // The rejected draft was rolled back: the next plain step continues the golden.
  StepItem next{.seq = *s2, .tokens = {&p.greedy[2], 1}, .sample = true};
  ASSERT_OK(without.Step(std::span<const StepItem>(&next, 1), &out));
  EXPECT_EQ(out.tokens[0], p.greedy[3]);
  ASSERT_OK(without.Close(*s2));
}

}  // namespace
}  // namespace numoe::engine
