// Speculative decoding over the shared-memory channel, in one process: RemoteExecutor (the worker side)
// -> channel -> a gpu WorkerSession running CpuModel with its DSpark drafter, whose MoE (main layers and
// drafter stages) comes back over the channel to ReferenceExperts. On tiny-v4:
//   - model drafts (StepItem::model_drafts) at depths 1..7 for 4 sequences at once emit exactly the
//     golden greedy tokens (the stages are random: acceptance is near zero, so this exercises rollback);
//   - with temperature > 0 the tokens equal one-process GenerateBatch's with the same drafter and seeds;
//   - worker drafts (StepItem::drafts) that are the goldens themselves are all accepted (1 + k tokens per
//     step), wrong ones are all rejected and rolled back, and the tokens still equal the goldens;
//   - every bad speculative field is refused by numoe-gpu with an error that names it, and the channel
//     stays usable; a gpu that cannot verify refuses drafts.
#include <gtest/gtest.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <span>
#include <vector>

#include "common/checkpoint.h"
#include "common/shm_channel.h"
#include "backends/cpu/cpu_model.h"
#include "worker/experts/reference_experts.h"
#include "model/generation.h"
#include "gpu_service/session.h"
#include "tests/support/fixtures.h"
#include "worker/engine/remote_executor.h"
#include "tests/support/status_matchers.h"

namespace numoe::engine {
namespace {

constexpr uint32_t kMaxRows = 64;

struct Rig {
  test::TinyModel* tiny = nullptr;  // the shared fixture: tiny-v4, with or without its DSpark drafter
  gpu::ModelHost host;
  std::unique_ptr<gpu::WorkerSession> session;
  std::unique_ptr<shm::Channel> worker_end;
  std::unique_ptr<RemoteExecutor> remote;
  test::Goldens goldens;
  int64_t vocab = 0;

  ~Rig() {
    if (session) session->Stop();
  }
};

// `drafter`: load the DSpark drafter (and its stages' experts) and announce it; `verify`: the geometry's
// verify flag.
std::unique_ptr<Rig> MakeRig(bool drafter, bool verify) {
  auto r = std::make_unique<Rig>();
  auto tiny = test::TinyModel::Get({.drafter = drafter});
  if (!tiny.ok()) {
    ADD_FAILURE() << tiny.status();
    return nullptr;
  }
  r->tiny = *tiny;
  r->host.model = r->tiny->model.get();
  const ModelConfig& cfg = r->tiny->ckpt->config();
  r->vocab = cfg.vocab_size;
  shm::Geometry geo{.hidden = static_cast<uint32_t>(cfg.hidden_size),
                    .top_k = static_cast<uint32_t>(cfg.num_experts_per_tok),
                    .max_rows = kMaxRows,
                    .max_seqs = 4,
                    .vocab = static_cast<uint32_t>(cfg.vocab_size),
                    .logits_rows = 0,
                    .drafter = drafter ? SpecMethod::kDspark : SpecMethod::kNone,
                    .max_model_drafts = drafter ? 16u : 0u,
                    .verify = verify ? 1u : 0u};
  auto gpu_end = shm::Channel::CreateAnonymous(geo);
  if (!gpu_end.ok()) {
    ADD_FAILURE() << gpu_end.status();
    return nullptr;
  }
  auto worker_end = (*gpu_end)->PeerEndpoint();
  if (!worker_end.ok()) {
    ADD_FAILURE() << worker_end.status();
    return nullptr;
  }
  r->worker_end = std::move(*worker_end);
  r->session = std::make_unique<gpu::WorkerSession>(&r->host, gpu::SessionInfo{.lease = 1, .worker_id = "spec"},
                                                    std::move(*gpu_end));
  r->session->Start(nullptr);
  r->remote = std::make_unique<RemoteExecutor>(r->worker_end.get(), r->tiny->experts.get());
  r->goldens = r->tiny->goldens;
  return r;
}

// Feeds the prompt in chunks that fit the channel; the last chunk samples. Returns the first token.
int32_t Prefill(Rig& r, ExecSeq seq, const std::vector<int32_t>& prompt) {
  StepOutput out;
  for (size_t at = 0; at < prompt.size(); at += kMaxRows) {
    const size_t n = std::min<size_t>(kMaxRows, prompt.size() - at);
    const bool last = at + n == prompt.size();
    StepItem item{.seq = seq, .tokens = std::span<const int32_t>(prompt.data() + at, n), .sample = last};
    Status st = r.remote->Step(std::span<const StepItem>(&item, 1), &out);
    EXPECT_OK(st);
    if (!st.ok()) return -1;
  }
  return out.tokens[0];
}

TEST(SpecChannel, LimitsReportTheGpusDrafter) {
  auto r = MakeRig(/*drafter=*/true, /*verify=*/true);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->remote->limits().drafter(), SpecMethod::kDspark);
  EXPECT_EQ(r->remote->limits().max_model_drafts(), 16);
  auto plain = MakeRig(/*drafter=*/false, /*verify=*/false);
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->remote->limits().drafter(), SpecMethod::kNone);
  EXPECT_EQ(plain->remote->limits().max_model_drafts(), 0);
}

struct SpecCounts {
  int64_t verify_steps = 0, drafted = 0, accepted = 0;
};

// Generates `want` tokens for every prompt at once over the remote executor, asking numoe-gpu's drafter
// for min(depth, tokens still wanted - 1) drafts per step (GenerateBatch's rule), and checks every
// StepOutput's per-item figures. Sequences are closed at the end.
std::vector<std::vector<int32_t>> GenerateRemote(Rig& r, const std::vector<std::vector<int32_t>>& prompts,
                                                 const std::vector<SamplingParams>& sampling, int32_t depth,
                                                 size_t want, SpecCounts* counts) {
  const size_t n = prompts.size();
  std::vector<ExecSeq> seqs;
  std::vector<std::vector<int32_t>> got(n);
  for (size_t i = 0; i < n; ++i) {
    auto s = r.remote->Open(sampling[i]);
    EXPECT_OK(s);
    if (!s.ok()) return {};
    seqs.push_back(*s);
    got[i].push_back(Prefill(r, *s, prompts[i]));
  }
  for (int step = 0; step < 200; ++step) {
    std::vector<StepItem> items;
    std::vector<size_t> owner;
    for (size_t i = 0; i < n; ++i) {
      if (got[i].size() >= want) continue;
      const int32_t k = std::min<int32_t>(depth, static_cast<int32_t>(want - got[i].size()) - 1);
      items.push_back(StepItem{.seq = seqs[i],
                               .tokens = std::span<const int32_t>(&got[i].back(), 1),
                               .sample = true,
                               .model_drafts = std::max(k, 0)});
      owner.push_back(i);
    }
    if (items.empty()) break;
    StepOutput out;
    Status st = r.remote->Step(items, &out);
    EXPECT_OK(st) << "depth " << depth << ": " << st;
    if (!st.ok()) return {};
    EXPECT_EQ(out.counts.size(), items.size());
    size_t at = 0;
    for (size_t j = 0; j < items.size() && j < out.counts.size(); ++j) {
      EXPECT_LE(out.drafted[j], items[j].model_drafts);
      EXPECT_LE(out.accepted[j], out.drafted[j]);
      EXPECT_EQ(out.counts[j], 1 + out.accepted[j]);
      EXPECT_EQ(out.tokens[j], out.emitted[at]);
      if (out.drafted[j] > 0) ++counts->verify_steps;
      counts->drafted += out.drafted[j];
      counts->accepted += out.accepted[j];
      got[owner[j]].insert(got[owner[j]].end(), out.emitted.begin() + static_cast<std::ptrdiff_t>(at),
                           out.emitted.begin() + static_cast<std::ptrdiff_t>(at + out.counts[j]));
      at += static_cast<size_t>(out.counts[j]);
    }
    EXPECT_EQ(at, out.emitted.size());
  }
  for (ExecSeq s : seqs) EXPECT_OK(r.remote->Close(s));
  EXPECT_OK(r.remote->Flush());
  return got;
}

// Greedy with the model drafter equals the goldens, every depth 1-7, four sequences per step.
TEST(SpecChannel, ModelDraftsEmitTheGreedyGoldensAtEveryDepth) {
  auto r = MakeRig(/*drafter=*/true, /*verify=*/true);
  ASSERT_NE(r, nullptr);
  ASSERT_EQ(r->goldens.size(), 4u);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& g : r->goldens) prompts.push_back(g.input_ids);
  SpecCounts c;
  for (int32_t depth = 1; depth <= 7; ++depth) {
    auto got = GenerateRemote(*r, prompts, std::vector<SamplingParams>(4), depth, r->goldens[0].greedy.size(), &c);
    ASSERT_EQ(got.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(got[i], r->goldens[i].greedy) << "depth " << depth << ", " << r->goldens[i].name;
  }
  std::cout << "model drafts, depths 1-7: " << c.verify_steps << " verify steps, " << c.drafted << " drafted, "
            << c.accepted << " accepted\n";
  EXPECT_GT(c.drafted, 0);
  EXPECT_GT(c.verify_steps, 0);
  EXPECT_EQ(r->host.spec_drafted.load(), static_cast<uint64_t>(c.drafted));
  EXPECT_EQ(r->host.spec_accepted.load(), static_cast<uint64_t>(c.accepted));
  EXPECT_EQ(r->session->sequences(), 0);
}

// With temperature the gpu draws drafts and verifies with the sequence's own sampler in GenerateBatch's
// order, so the tokens equal one-process GenerateBatch with the same spec and seeds.
TEST(SpecChannel, SampledSpeculativeTokensEqualGenerateBatch) {
  auto r = MakeRig(/*drafter=*/true, /*verify=*/true);
  ASSERT_NE(r, nullptr);
  auto local = cpu::CpuModel::Create(*r->tiny->ckpt, nullptr, {.drafter = true});
  ASSERT_OK(local);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<SamplingParams> sampling;
  std::vector<GenerateRequest> reqs;
  for (size_t i = 0; i < r->goldens.size(); ++i) {
    prompts.push_back(r->goldens[i].input_ids);
    sampling.push_back(SamplingParams{.temperature = 0.9, .top_p = 0.95, .top_k = 0, .seed = 1234 + i});
    reqs.push_back(GenerateRequest{.prompt = prompts.back(),
                                   .max_new_tokens = 24,
                                   .sampling = sampling.back(),
                                   .ignore_eos = true,
                                   .prefill_chunk = kMaxRows});
  }
  const int32_t depth = 3;
  auto want = GenerateBatch(**local, *r->tiny->experts, reqs, nullptr,
                            SpecConfig{.method = SpecMethod::kDspark, .depth = depth});
  ASSERT_OK(want);
  SpecCounts c;
  auto got = GenerateRemote(*r, prompts, sampling, depth, 24, &c);
  ASSERT_EQ(got.size(), want->size());
  int sampled_away = 0;  // temperature really sampled: not the greedy continuation
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i], (*want)[i].tokens) << r->goldens[i].name;
    const auto& g = r->goldens[i].greedy;
    sampled_away += std::vector<int32_t>(g.begin(), g.begin() + 24) != got[i];
  }
  EXPECT_GT(sampled_away, 0);
  EXPECT_GT(c.drafted, 0);
}

// Worker drafts: right ones are all kept (1 + k tokens per step), wrong ones all rolled back.
TEST(SpecChannel, WorkerDraftsAreAcceptedWhenRightAndRolledBackWhenWrong) {
  auto r = MakeRig(/*drafter=*/false, /*verify=*/true);
  ASSERT_NE(r, nullptr);
  for (const test::GoldenPrompt& g : r->goldens) {
    auto seq = r->remote->Open(SamplingParams{});
    ASSERT_OK(seq);
    std::vector<int32_t> got = {Prefill(*r, *seq, g.input_ids)};
    const size_t want = g.greedy.size();
    int64_t full = 0, none = 0;
    for (int step = 0; got.size() < want && step < 100; ++step) {
      const size_t i = got.size() - 1;  // got[i] == greedy[i] was sampled, not yet fed
      const size_t k = std::min<size_t>(1 + step % 5, want - got.size() - 1);  // greedy[i + 1 + k] exists
      const bool right = step % 2 == 0;
      std::vector<int32_t> feed = {got.back()};
      for (size_t d = 0; d < k; ++d) {
        const int32_t t = g.greedy[i + 1 + d];
        feed.push_back(right ? t : static_cast<int32_t>((t + 1) % r->vocab));
      }
      StepItem item{.seq = *seq, .tokens = feed, .sample = true, .drafts = static_cast<int32_t>(k)};
      StepOutput out;
      Status st = r->remote->Step(std::span<const StepItem>(&item, 1), &out);
      ASSERT_OK(st);
      EXPECT_EQ(out.drafted[0], static_cast<int32_t>(k));
      if (k > 0 && right) {
        EXPECT_EQ(out.accepted[0], static_cast<int32_t>(k)) << g.name << " step " << step;
        ++full;
      }
      if (k > 0 && !right) {
        EXPECT_EQ(out.accepted[0], 0) << g.name << " step " << step;
        ++none;
      }
      got.insert(got.end(), out.emitted.begin(), out.emitted.end());
    }
    got.resize(std::min(got.size(), want));
    EXPECT_EQ(got, g.greedy) << g.name;
    EXPECT_GT(full, 0);
    EXPECT_GT(none, 0);
    ASSERT_OK(r->remote->Close(*seq));
  }
}

// Raw StepRequests with bad speculative fields: numoe-gpu answers an Error naming the field.
Status RawStep(shm::Channel& ch, const std::vector<shm::StepEntry>& entries, const std::vector<int32_t>& tokens) {
  for (size_t i = 0; i < entries.size(); ++i) ch.entries()[i] = entries[i];
  std::copy(tokens.begin(), tokens.end(), ch.tokens());
  ch.outgoing().num_entries = static_cast<int64_t>(entries.size());
  ch.outgoing().num_tokens = static_cast<int64_t>(tokens.size());
  ch.outgoing().num_releases = 0;
  RETURN_IF_ERROR(ch.Send(shm::MsgType::kStepRequest));
  ASSIGN_OR_RETURN(shm::MsgType t, ch.Receive(30000));
  if (t == shm::MsgType::kError) return ch.IncomingError();
  if (t != shm::MsgType::kStepResult) return absl::InternalError(absl::StrCat("got ", shm::MsgTypeName(t)));
  return absl::OkStatus();
}

TEST(SpecChannel, BadSpeculativeFieldsAreRefusedByName) {
  auto r = MakeRig(/*drafter=*/true, /*verify=*/true);
  ASSERT_NE(r, nullptr);
  auto seq = r->remote->Open(SamplingParams{});
  ASSERT_OK(seq);
  const int32_t first = Prefill(*r, *seq, r->goldens[2].input_ids);  // opens it on the gpu
  ASSERT_EQ(first, r->goldens[2].greedy[0]);
  shm::Channel& ch = *r->worker_end;
  const uint32_t sample = shm::kEntrySample;
  struct Case {
    shm::StepEntry e;
    std::vector<int32_t> tokens;
    const char* needle;
  };
  const std::vector<Case> cases = {
      {{.seq = *seq, .num_tokens = 1, .flags = sample, .model_drafts = 17}, {5}, "max_model_drafts"},
      {{.seq = *seq, .num_tokens = 2, .flags = sample, .model_drafts = 2}, {5, 6}, "model_drafts needs num_tokens 1"},
      {{.seq = *seq, .num_tokens = 2, .flags = sample, .drafts = 2}, {5, 6}, "drafts 2 must be < num_tokens 2"},
      {{.seq = *seq, .num_tokens = 2, .flags = 0, .drafts = 1}, {5, 6}, "drafts without the sample flag"},
      {{.seq = *seq, .num_tokens = 2, .flags = sample, .drafts = 1, .model_drafts = 1}, {5, 6}, "both drafts"},
      {{.seq = *seq, .num_tokens = 1, .flags = sample, .drafts = -1}, {5}, "must be >= 0"},
      {{.seq = 999, .num_tokens = 2, .flags = sample | shm::kEntryOpen, .drafts = 1}, {5, 6}, "opens the sequence"},
  };
  for (const Case& c : cases) {
    Status st = RawStep(ch, {c.e}, c.tokens);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.needle << ": " << st;
    EXPECT_NE(st.message().find(c.needle), std::string::npos) << st;
  }
  // Rows = tokens + model drafts over the step: 60 tokens + 16 drafts > 64.
  {
    auto other = r->remote->Open(SamplingParams{});
    ASSERT_OK(other);
    ASSERT_GE(Prefill(*r, *other, r->goldens[0].input_ids), 0);
    std::vector<int32_t> tokens(60, 5);
    Status st = RawStep(ch,
                        {shm::StepEntry{.seq = *seq, .num_tokens = 1, .flags = sample, .model_drafts = 16},
                         shm::StepEntry{.seq = *other, .num_tokens = 59}},
                        tokens);
    EXPECT_NE(st.message().find("more than max_rows 64"), std::string::npos) << st;
  }
  // The executor refuses what it can see without a round trip.
  StepItem too_many{.seq = *seq, .tokens = std::span<const int32_t>(&first, 1), .sample = true, .model_drafts = 17};
  StepOutput out;
  EXPECT_EQ(r->remote->Step(std::span<const StepItem>(&too_many, 1), &out).code(), absl::StatusCode::kInvalidArgument);
  // Still usable: a correct speculative step on the same sequence.
  StepItem ok{.seq = *seq, .tokens = std::span<const int32_t>(&first, 1), .sample = true, .model_drafts = 3};
  Status st = r->remote->Step(std::span<const StepItem>(&ok, 1), &out);
  ASSERT_OK(st);
  EXPECT_EQ(out.tokens[0], r->goldens[2].greedy[1]);
  EXPECT_TRUE(r->remote->healthy());

  // A gpu without a drafter that cannot verify: model drafts and worker drafts are both refused.
  auto plain = MakeRig(/*drafter=*/false, /*verify=*/false);
  ASSERT_NE(plain, nullptr);
  auto s2 = plain->remote->Open(SamplingParams{});
  ASSERT_OK(s2);
  ASSERT_GE(Prefill(*plain, *s2, plain->goldens[2].input_ids), 0);
  Status a = RawStep(*plain->worker_end, {shm::StepEntry{.seq = *s2, .num_tokens = 2, .flags = sample, .drafts = 1}},
                     {5, 6});
  EXPECT_NE(a.message().find("cannot verify drafts"), std::string::npos) << a;
  StepItem d{.seq = *s2, .tokens = std::span<const int32_t>(&first, 1), .sample = true, .model_drafts = 2};
  EXPECT_EQ(plain->remote->Step(std::span<const StepItem>(&d, 1), &out).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace numoe::engine
