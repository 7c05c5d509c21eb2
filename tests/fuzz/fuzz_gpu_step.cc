// Fuzzes numoe-gpu's side of the shared-memory data plane (gpu_service/session.h): a hostile worker. Two
// WorkerSessions share one model, as in numoe-gpu: a victim whose worker is well-behaved, and an attacker
// whose every message (StepRequests with any header, entries, tokens, releases, forks and biases, other
// message types, MoeResponses with any layer/rows/values, Errors) comes from the input. The model is a
// stand-in ModelBackend that checks how it is called (every sequence alive, each touched only from the
// session's thread that created it) and calls the experts over the channel like a real one.
// Properties: numoe-gpu answers every StepRequest (StepResult within the channel's capacities, or Error);
// it never hangs; the attacker never touches the victim's sequences; the attacker's sequences are all
// freed when its session stops; the victim keeps serving.
#include <fuzzer/FuzzedDataProvider.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/shm_channel.h"
#include "gpu_service/session.h"

namespace numoe::gpu {
namespace {

[[noreturn]] void Fail(const std::string& why) {
  std::fprintf(stderr, "gpu step fuzz: %s\n", why.c_str());
  std::abort();
}

constexpr int64_t kVocab = 64;
constexpr int64_t kHidden = 4;
constexpr int64_t kTopK = 2;

// A model that only keeps positions, computes a deterministic "forward" and sends one MoE call per step.
class CheckingModel : public ModelBackend {
 public:
  CheckingModel() {
    config_.vocab_size = kVocab;
    config_.max_position_embeddings = 1 << 20;
  }
  StatusOr<SequenceId> CreateSequence() override {
    std::lock_guard<std::mutex> lk(mu_);
    const SequenceId id = next_++;
    seqs_[id] = Seq{0, std::this_thread::get_id(), false};
    return id;
  }
  Status ReleaseSequence(SequenceId seq) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (seqs_.erase(seq) == 0) Fail("release of a sequence that is not alive: " + std::to_string(seq));
    return absl::OkStatus();
  }
  Status Forward(std::span<const SequenceStep> steps, ExpertBackend* experts,
                 std::vector<SequenceLogits>* out) override {
    RETURN_IF_ERROR(ValidateSequenceSteps(steps, config_, [this](SequenceId s) -> StatusOr<int64_t> {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = seqs_.find(s);
      if (it == seqs_.end()) Fail("Forward on a sequence that is not alive");
      Own(it->second);
      return it->second.position;
    }));
    int64_t rows = 0;
    for (const SequenceStep& st : steps) rows += static_cast<int64_t>(st.tokens.size());
    std::vector<float> x(static_cast<size_t>(rows * kHidden), 0.5f), w(static_cast<size_t>(rows * kTopK), 0.5f);
    std::vector<int32_t> ids(static_cast<size_t>(rows * kTopK), 1);
    std::vector<float> moe(static_cast<size_t>(rows * kHidden));
    RETURN_IF_ERROR(experts->RunRouted(
        MoeRequest{.layer = 0, .rows = rows, .top_k = kTopK, .x = x.data(), .expert_ids = ids.data(),
                   .expert_weights = w.data(), .out = moe.data()}));
    out->clear();
    std::lock_guard<std::mutex> lk(mu_);
    for (const SequenceStep& st : steps) {
      Seq& s = seqs_.at(st.seq);
      s.position += static_cast<int64_t>(st.tokens.size());
      s.speculative = st.speculative;
      SequenceLogits lg{st.seq, st.all_logits ? static_cast<int64_t>(st.tokens.size()) : 1, {}};
      lg.logits.resize(static_cast<size_t>(lg.rows * kVocab));
      for (size_t i = 0; i < lg.logits.size(); ++i) {
        lg.logits[i] = static_cast<float>((i * 7 + static_cast<size_t>(s.position)) % 13) * 0.25f;
      }
      out->push_back(std::move(lg));
    }
    return absl::OkStatus();
  }
  StatusOr<SequenceMemory> Memory(SequenceId seq) const override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return absl::NotFoundError("no such sequence");
    return SequenceMemory{.position = it->second.position};
  }
  Status Rollback(SequenceId seq, int64_t num_tokens) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) Fail("Rollback of a sequence that is not alive");
    Own(it->second);
    if (!it->second.speculative || num_tokens < 0 || num_tokens > it->second.position) Fail("bad Rollback");
    it->second.position -= num_tokens;
    it->second.speculative = false;
    return absl::OkStatus();
  }
  StatusOr<SequenceId> ForkSequence(SequenceId parent) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seqs_.find(parent);
    if (it == seqs_.end()) Fail("Fork of a sequence that is not alive");
    Own(it->second);
    if (it->second.speculative) return absl::FailedPreconditionError("the parent's last step was speculative");
    const SequenceId id = next_++;
    seqs_[id] = Seq{it->second.position, std::this_thread::get_id(), false};
    return id;
  }
  Capabilities capabilities() const override {
    return Capabilities{.verify = true, .drafter = SpecMethod::kMtp, .max_spec_tokens = 0, .fork = true};
  }
  Status Draft(std::span<const DraftRequest> requests, ExpertBackend* experts, std::vector<DraftResult>* out) override {
    (void)experts;
    out->clear();
    for (const DraftRequest& q : requests) {
      RETURN_IF_ERROR(ValidateDraftRequest(q, kVocab));
      {
        std::lock_guard<std::mutex> lk(mu_);
        auto it = seqs_.find(q.seq);
        if (it == seqs_.end()) Fail("Draft on a sequence that is not alive");
        Own(it->second);
      }
      DraftResult r{q.seq, {}, {}, {}};
      for (int64_t d = 0; d < q.depth; ++d) r.tokens.push_back(static_cast<int32_t>((q.next_token + d + 1) % kVocab));
      r.logits.assign(static_cast<size_t>(q.depth * kVocab), 0.0f);
      for (int64_t d = 0; d < q.depth; ++d) r.logits[static_cast<size_t>(d * kVocab + r.tokens[d])] = 4.0f;
      r.confidence.assign(static_cast<size_t>(q.depth), 1.0f);
      out->push_back(std::move(r));
    }
    return absl::OkStatus();
  }
  int64_t vocab_size() const override { return kVocab; }

  size_t alive() const {
    std::lock_guard<std::mutex> lk(mu_);
    return seqs_.size();
  }
  std::map<SequenceId, int64_t> Positions() const {
    std::lock_guard<std::mutex> lk(mu_);
    std::map<SequenceId, int64_t> p;
    for (const auto& [id, s] : seqs_) p[id] = s.position;
    return p;
  }

 private:
  struct Seq {
    int64_t position = 0;
    std::thread::id owner;  // the session thread that created it (its forks and steps run there too)
    bool speculative = false;
  };
  static void Own(const Seq& s) {
    if (s.owner != std::this_thread::get_id()) Fail("a session touched a sequence of another session");
  }
  ModelConfig config_;
  mutable std::mutex mu_;
  std::map<SequenceId, Seq> seqs_;
  SequenceId next_ = 1;
};

shm::Geometry AttackerGeometry() {
  return shm::Geometry{.hidden = kHidden, .top_k = kTopK, .max_rows = 16, .max_seqs = 4, .vocab = kVocab,
                       .logits_rows = 2, .drafter = SpecMethod::kMtp, .max_model_drafts = 3, .verify = 1, .fork = 1};
}

// The worker end of a session: sends what it is given, answers MoeRequests with `moe`, returns the step's end.
struct WorkerEnd {
  std::unique_ptr<shm::Channel> gpu_side;  // handed to the session
  std::unique_ptr<shm::Channel> ch;        // the worker's endpoint
};

WorkerEnd MakeChannel() {
  auto gpu = shm::Channel::CreateAnonymous(AttackerGeometry(), shm::ChannelOptions{.spin_us = 5, .poll_ms = 5});
  if (!gpu.ok()) Fail(gpu.status().ToString());
  auto worker = (*gpu)->PeerEndpoint();
  if (!worker.ok()) Fail(worker.status().ToString());
  return WorkerEnd{std::move(*gpu), std::move(*worker)};
}

// Waits for the gpu's next message while the session lives; nullopt when the session ended.
std::optional<shm::MsgType> Await(shm::Channel& ch, const WorkerSession& session) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {
    auto t = ch.Receive(20);
    if (t.ok()) return *t;
    if (t.status().code() != absl::StatusCode::kDeadlineExceeded) return std::nullopt;
    if (session.ended()) return std::nullopt;
    if (std::chrono::steady_clock::now() > deadline) Fail("numoe-gpu did not answer within 10 s");
  }
}

// The one victim: a well-behaved worker with three open sequences, checked after every input.
struct Victim {
  Victim(ModelHost* host, CheckingModel* model) : model(model) {
    WorkerEnd w = MakeChannel();
    ch = std::move(w.ch);
    session = std::make_unique<WorkerSession>(host, SessionInfo{1, "victim", 0}, std::move(w.gpu_side));
    session->Start(nullptr);
    const size_t before = model->alive();
    Step(/*open=*/true);
    if (model->alive() != before + 3) Fail("victim setup");
  }
  // One step over keys 10, 11, 12: a 2-token prefill when opening, else a 1-token decode.
  void Step(bool open) {
    shm::MsgHeader& m = ch->outgoing();
    m = shm::MsgHeader{};
    int64_t t = 0;
    for (int i = 0; i < 3; ++i) {
      shm::StepEntry& e = ch->entries()[i];
      e = shm::StepEntry{};
      e.seq = 10 + i;
      e.num_tokens = open ? 2 : 1;
      e.flags = shm::kEntrySample | (open ? shm::kEntryOpen : 0u);
      e.sampling.temperature = 0.0;
      for (int k = 0; k < e.num_tokens; ++k) ch->tokens()[t++] = 3 + i;
    }
    m.num_entries = 3;
    m.num_tokens = t;
    if (!ch->Send(shm::MsgType::kStepRequest).ok()) Fail("victim send");
    for (;;) {
      auto type = Await(*ch, *session);
      if (!type) Fail("the victim's session ended: " + session->end_status().ToString());
      if (*type == shm::MsgType::kMoeRequest) {
        const shm::MsgHeader in = ch->incoming();
        shm::MsgHeader& r = ch->outgoing();
        r = shm::MsgHeader{};
        r.layer = in.layer;
        r.rows = in.rows;
        std::memset(ch->moe_out(), 0, static_cast<size_t>(in.rows * kHidden) * sizeof(float));
        if (!ch->Send(shm::MsgType::kMoeResponse).ok()) Fail("victim MoE send");
        continue;
      }
      if (*type != shm::MsgType::kStepResult) Fail("victim step failed: " + ch->IncomingError().ToString());
      break;
    }
  }
  void Check() {
    if (session->sequences() != 3) Fail("the victim's sequences changed");
    const auto before = model->Positions();
    Step(/*open=*/false);
    const auto after = model->Positions();
    int advanced = 0;
    for (const auto& [id, pos] : after) {
      auto it = before.find(id);
      if (it != before.end() && pos == it->second + 1) ++advanced;
    }
    if (advanced != 3) Fail("the victim's decode step did not advance its three sequences");
  }
  CheckingModel* model;
  std::unique_ptr<shm::Channel> ch;
  std::unique_ptr<WorkerSession> session;
};

double PickDouble(FuzzedDataProvider& fdp) {
  static constexpr double kValues[] = {0.0, 1.0, 0.5, 2.0, -1.0, 1e300, -0.0, 3.0,
                                       std::numeric_limits<double>::quiet_NaN(),
                                       std::numeric_limits<double>::infinity()};
  if (fdp.ConsumeBool()) return kValues[fdp.ConsumeIntegralInRange<size_t>(0, std::size(kValues) - 1)];
  return fdp.ConsumeFloatingPoint<double>();
}

void FillSampling(FuzzedDataProvider& fdp, shm::WireSampling* s) {
  *s = shm::WireSampling{};
  if (fdp.ConsumeBool()) return;  // defaults
  s->temperature = PickDouble(fdp);
  s->top_p = fdp.ConsumeBool() ? 1.0 : PickDouble(fdp);
  s->top_k = fdp.ConsumeIntegralInRange<int64_t>(-2, 70);
  s->seed = fdp.ConsumeIntegral<uint64_t>();
  if (fdp.ConsumeBool()) {
    s->min_p = PickDouble(fdp);
    s->presence_penalty = PickDouble(fdp);
    s->frequency_penalty = PickDouble(fdp);
    s->repetition_penalty = PickDouble(fdp);
  }
  s->logprobs = fdp.ConsumeIntegralInRange<int32_t>(-2, 22);
  s->num_bias = fdp.ConsumeIntegralInRange<int32_t>(-1, 3);
}

int64_t Count(FuzzedDataProvider& fdp, int64_t consistent) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return fdp.ConsumeIntegral<int64_t>();
    case 1: return consistent + fdp.ConsumeIntegralInRange<int64_t>(-2, 2);
    default: return consistent;
  }
}

// Writes one StepRequest from the input into the attacker's up slot.
void WriteStepRequest(FuzzedDataProvider& fdp, shm::Channel& ch) {
  const shm::Geometry& g = ch.geometry();
  shm::MsgHeader& m = ch.outgoing();
  m = shm::MsgHeader{};
  const int64_t entries = fdp.ConsumeIntegralInRange<int64_t>(0, g.max_seqs);
  int64_t tokens = 0, biases = 0;
  for (int64_t i = 0; i < entries; ++i) {
    shm::StepEntry& e = ch.entries()[i];
    e = shm::StepEntry{};
    e.seq = fdp.ConsumeBool() ? fdp.ConsumeIntegralInRange<int64_t>(0, 5) : fdp.ConsumeIntegral<int64_t>();
    e.num_tokens = fdp.ConsumeIntegralInRange<int32_t>(-1, 6);
    e.flags = fdp.ConsumeBool() ? fdp.ConsumeIntegralInRange<uint32_t>(0, 7) : fdp.ConsumeIntegral<uint32_t>();
    FillSampling(fdp, &e.sampling);
    if (e.sampling.num_bias > 0) biases += e.sampling.num_bias;
    e.drafts = fdp.ConsumeIntegralInRange<int32_t>(-1, 4);
    e.model_drafts = fdp.ConsumeIntegralInRange<int32_t>(-1, 4);
    for (int32_t k = 0; k < e.num_tokens && tokens < g.max_rows; ++k) {
      ch.tokens()[tokens++] = fdp.ConsumeIntegralInRange<int32_t>(-1, kVocab);
    }
  }
  const int64_t releases = fdp.ConsumeIntegralInRange<int64_t>(0, g.max_seqs);
  for (int64_t i = 0; i < releases; ++i) ch.releases()[i] = fdp.ConsumeIntegralInRange<int64_t>(0, 12);
  const int64_t forks = fdp.ConsumeIntegralInRange<int64_t>(0, 2);
  for (int64_t i = 0; i < forks; ++i) {
    shm::WireFork& f = ch.forks()[i];
    f.seq = fdp.ConsumeIntegralInRange<int64_t>(0, 12);
    f.parent = fdp.ConsumeIntegralInRange<int64_t>(0, 12);
    FillSampling(fdp, &f.sampling);
    if (f.sampling.num_bias > 0) biases += f.sampling.num_bias;
  }
  const int64_t max_biases = int64_t{g.max_seqs} * shm::kMaxWireBias;
  for (int64_t i = 0; i < std::min<int64_t>(biases, max_biases); ++i) {
    ch.biases()[i] = shm::WireBias{fdp.ConsumeIntegralInRange<int32_t>(-1, kVocab), static_cast<float>(PickDouble(fdp))};
  }
  m.num_entries = Count(fdp, entries);
  m.num_tokens = Count(fdp, tokens);
  m.num_releases = Count(fdp, releases);
  m.num_forks = Count(fdp, forks);
  m.num_biases = Count(fdp, biases);
}

// The step's answer from numoe-gpu must fit what the attacker's channel can hold.
void CheckResult(const shm::Channel& ch) {
  const shm::Geometry& g = ch.geometry();
  const shm::MsgHeader m = ch.incoming();
  if (m.num_entries < 0 || m.num_entries > g.max_seqs || m.num_emitted < 0 || m.num_emitted > g.max_rows ||
      m.num_logits < 0 || m.num_logits > g.logits_rows || (m.num_logprobs != 0 && m.num_logprobs != m.num_emitted)) {
    Fail("a StepResult outside the channel's capacities");
  }
  int64_t emitted = 0;
  for (int64_t i = 0; i < m.num_entries; ++i) emitted += ch.counts()[i];
  if (emitted != m.num_emitted) Fail("counts do not add up to num_emitted");
  for (int64_t i = 0; i < m.num_emitted; ++i) {
    if (ch.emitted()[i] < 0 || ch.emitted()[i] >= kVocab) Fail("an emitted token outside the vocabulary");
  }
}

// How the attacker's steps ended, printed at exit with NUMOE_FUZZ_STATS=1 (to see that inputs get past the checks).
struct Outcomes {
  std::atomic<uint64_t> results{0}, errors{0}, ended{0};
  ~Outcomes() {
    if (std::getenv("NUMOE_FUZZ_STATS") != nullptr) {
      std::fprintf(stderr, "gpu step fuzz: %lu StepResults, %lu Errors, %lu sessions ended by the worker\n",
                   static_cast<unsigned long>(results.load()), static_cast<unsigned long>(errors.load()),
                   static_cast<unsigned long>(ended.load()));
    }
  }
};
Outcomes outcomes;

struct World {
  World() {
    host.model = &model;
    victim = std::make_unique<Victim>(&host, &model);
  }
  CheckingModel model;
  ModelHost host;
  std::unique_ptr<Victim> victim;
};

}  // namespace
}  // namespace numoe::gpu

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace numoe;
  using namespace numoe::gpu;
  static World* world = new World();
  FuzzedDataProvider fdp(data, size);
  const size_t alive_before = world->model.alive();
  {
    WorkerEnd w = MakeChannel();
    shm::Channel& ch = *w.ch;
    WorkerSession session(&world->host, SessionInfo{2, "attacker", 0}, std::move(w.gpu_side));
    session.Start(nullptr);
    for (int msg = 0; msg < 8 && fdp.remaining_bytes() > 0 && !session.ended(); ++msg) {
      const int kind = fdp.ConsumeIntegralInRange<int>(0, 9);
      if (kind == 0) {  // a message of another type where a StepRequest belongs
        ch.outgoing() = shm::MsgHeader{};
        const auto type = static_cast<shm::MsgType>(fdp.ConsumeIntegralInRange<uint32_t>(2, 5));
        if (type == shm::MsgType::kError) {
          (void)ch.SendError(absl::InternalError(fdp.ConsumeRandomLengthString(64)));
        } else {
          (void)ch.Send(type);
        }
      } else if (kind == 1) {  // raw bytes as the header
        shm::MsgHeader raw{};
        const std::string bytes = fdp.ConsumeBytesAsString(sizeof(raw));
        std::memcpy(&raw, bytes.data(), bytes.size());
        ch.outgoing() = raw;
        (void)ch.Send(shm::MsgType::kStepRequest);
      } else {
        WriteStepRequest(fdp, ch);
        (void)ch.Send(shm::MsgType::kStepRequest);
      }
      // Serve the step's MoE calls as the input says, until its result.
      for (;;) {
        auto type = Await(ch, session);
        if (!type) {
          ++outcomes.ended;
          break;
        }
        if (*type == shm::MsgType::kMoeRequest) {
          const shm::MsgHeader in = ch.incoming();
          if (in.rows < 0 || in.rows > ch.geometry().max_rows) Fail("a MoeRequest past max_rows");
          shm::MsgHeader& r = ch.outgoing();
          r = shm::MsgHeader{};
          const int how = fdp.ConsumeIntegralInRange<int>(0, 5);
          if (how == 0) {
            (void)ch.SendError(absl::InternalError("experts failed"));
            continue;
          }
          r.layer = how == 1 ? fdp.ConsumeIntegral<int64_t>() : in.layer;
          r.rows = how == 2 ? fdp.ConsumeIntegral<int64_t>() : in.rows;
          r.compute_ns = fdp.ConsumeIntegral<int64_t>();
          for (int64_t i = 0; i < in.rows * kHidden; ++i) ch.moe_out()[i] = static_cast<float>(PickDouble(fdp));
          (void)ch.Send(how == 3 ? shm::MsgType::kStepRequest : shm::MsgType::kMoeResponse);
          continue;
        }
        if (*type == shm::MsgType::kStepResult) {
          CheckResult(ch);
          ++outcomes.results;
        } else {
          ++outcomes.errors;
        }
        break;
      }
    }
    session.Stop();
  }
  if (world->model.alive() != alive_before) Fail("the attacker's sequences were not all freed");
  world->victim->Check();
  return 0;
}
