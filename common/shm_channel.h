// The per-layer data plane between one numoe-worker and numoe-gpu: one shared-memory region per worker,
// one message slot per direction, a doorbell per direction (spin, then futex), liveness checks on the peer.
//
// Conversation (strict ping-pong: a side sends only after it received the peer's previous message, so
// one slot per direction is enough and messages are never overwritten unread):
//
//   worker                                   gpu
//   StepRequest (entries, tokens, releases) ->
//                                         <- MoeRequest  (layer, rows, x, expert ids, weights)
//   MoeResponse (rows of the expert sum)   ->
//                 ... one MoeRequest/MoeResponse pair per layer (and per micro-step) ...
//                                         <- StepResult  (per entry: emitted tokens, drafts verified and
//                                                         accepted; logits)
//   (either side may answer with Error instead; the conversation then returns to idle)
//
// Layout of the region (every array 64-byte aligned, capacities from Geometry; see ComputeLayout):
//   [Header: magic, version, geometry, offsets, pids, closed flags]
//   [Doorbell to_gpu][Doorbell to_worker]                 one cache line each
//   up slot   (worker -> gpu): MsgHeader, entries[max_seqs], tokens[max_rows] i32, releases[max_seqs] i64,
//                              forks[max_seqs] WireFork, biases[max_seqs x kMaxWireBias] WireBias,
//                              grammars[kMaxWireGrammarBytes] bytes, moe_out[max_rows x hidden] f32, error text
//   down slot (gpu -> worker): MsgHeader, x[max_rows x hidden] f32, ids[max_rows x top_k] i32,
//                              weights[max_rows x top_k] f32, sampled[max_seqs] i32, counts[max_seqs] i32,
//                              drafted[max_seqs] i32, accepted[max_seqs] i32, cached[max_seqs] i32,
//                              emitted[max_rows] i32,
//                              logprobs[max_rows x (1 + kMaxWireTopLogprobs)] WireLogprob,
//                              logits[logits_rows x vocab] f32, error text
// The arrays are read and written in place (zero copy): the worker's expert backend reads x straight
// from the down slot and writes its sum straight into the up slot.
//
// Speculative decoding (model/spec.h has the rule): an entry may carry `drafts` (trailing
// draft tokens of a weightless drafter, e.g. n-gram, run by the worker) or ask for `model_drafts` (numoe-gpu
// drafts with the model's own drafter, Geometry::drafter). numoe-gpu runs the target once over
// [last token, drafts], verifies, rolls the rejected positions back in every cache and answers with the
// entry's emitted tokens (1 + accepted). An entry occupies num_tokens + model_drafts rows of max_rows, so
// the emitted tokens of one step always fit emitted[max_rows].
//
// Sampling extras: the logit bias of each fork, then of each opening entry, in that order, follows the
// previous ones' in `biases` (WireSampling::num_bias pairs each). An entry whose sequence asked for
// log-probs (WireSampling::logprobs >= 0) gets, for each emitted token, the chosen token's log-prob then its
// top ones in that token's row of `logprobs` (num_logprobs says whether the rows were written: 0, or
// num_emitted). The grammar spec of each opening entry (WireSampling::grammar_bytes, constrained output,
// common/tokenizer/grammar.h) follows the previous ones' in `grammars`; a fork carries none (it follows its
// parent's grammar).
//
// Forks (Geometry::fork): a StepRequest's `forks` create sequences as copies of open ones (state and
// penalty history, with their own sampling), before its releases and its step run, so n choices of one
// prompt prefill it once. A forked sequence is open: its first entry carries no kEntryOpen.
//
// Doorbell: the sender publishes the message by incrementing a 32-bit counter (release); the receiver
// spins on it for `spin_us`, then sleeps in FUTEX_WAIT (shared futex, works across processes) in slices of
// `poll_ms`, and between slices checks that the peer is alive (pidfd of the peer's pid; its `closed` flag)
// and the caller's deadline. So a dead peer is an UNAVAILABLE error within ~poll_ms, never a hang.
//
// Thread-safety: one thread per side uses a Channel at a time (the conversation is sequential);
// Interrupt() and Close() may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "common/config.h"
#include "common/sampling_limits.h"
#include "common/status.h"

namespace numoe::shm {

inline constexpr uint64_t kMagic = 0x314d48535f454f4eULL;  // "NOE_SHM1" little-endian
inline constexpr uint32_t kVersion = 6;  // 2: speculative decoding (drafts, emitted tokens); 3: penalties,
                                         // logit bias, log-probs, forks; 4: prefix cache (cached, cache bytes);
                                         // 5: grammars; 6: prefix cache host tier (host bytes, evictions
                                         // per tier)
inline constexpr size_t kErrorTextBytes = 1024;
// Capacities of the sampling extras (common/sampling_limits.h).
inline constexpr uint32_t kMaxWireBias = static_cast<uint32_t>(kMaxLogitBias);
inline constexpr uint32_t kMaxWireTopLogprobs = static_cast<uint32_t>(kMaxTopLogprobs);
// Bytes of grammar specs one StepRequest carries (over all its opening entries).
inline constexpr uint32_t kMaxWireGrammarBytes = 1u << 20;

// Capacities of one channel, and what numoe-gpu can do with it. Limits (ValidateGeometry): hidden in
// [1, 65536], top_k in [1, 64], max_rows in [1, 65536], max_seqs in [1, 4096], vocab in [1, 1<<24],
// logits_rows in [0, max_seqs], drafter kNone, kDspark or kMtp, max_model_drafts in [0, 4096] and 0 without a
// drafter, verify 0 or 1 (and 1 with a drafter), fork 0 or 1, and the whole region at most 16 GiB.
struct Geometry {
  uint32_t hidden = 0;       // D: width of one MoE row (fp32)
  uint32_t top_k = 0;        // routed experts per row
  uint32_t max_rows = 0;     // tokens per step = MoE rows per layer
  uint32_t max_seqs = 0;     // sequences per step
  uint32_t vocab = 0;        // logits width
  uint32_t logits_rows = 0;  // StepResult logits capacity in rows of `vocab` (0: logits never returned)
  // Speculative decoding: the model drafter StepEntry::model_drafts uses (kNone: none loaded), the
  // most model drafts one entry may ask for, and whether numoe-gpu verifies drafts at all (its backend
  // runs speculative steps and rolls them back; 0: entries must carry no drafts).
  SpecMethod drafter = SpecMethod::kNone;  // 4 bytes on the wire (SpecMethod is uint32_t)
  uint32_t max_model_drafts = 0;
  uint32_t verify = 0;
  uint32_t fork = 0;  // StepRequest forks are served (the backend's Capabilities::fork)
};
static_assert(sizeof(SpecMethod) == sizeof(uint32_t), "Geometry::drafter is a uint32_t on the wire");
Status ValidateGeometry(const Geometry& g);

// Byte offsets of every array from the start of the region.
struct Layout {
  size_t header = 0, to_gpu = 0, to_worker = 0;
  size_t up_msg = 0, entries = 0, tokens = 0, releases = 0, forks = 0, biases = 0, grammars = 0, moe_out = 0,
         up_error = 0;
  size_t down_msg = 0, moe_x = 0, moe_ids = 0, moe_weights = 0, sampled = 0, counts = 0, drafted = 0, accepted = 0,
         cached = 0, emitted = 0, logprobs = 0, logits = 0, down_error = 0;
  size_t total = 0;
};
Layout ComputeLayout(const Geometry& g);

enum class MsgType : uint32_t {
  kNone = 0,
  kStepRequest = 1,  // worker -> gpu
  kMoeRequest = 2,   // gpu -> worker
  kMoeResponse = 3,  // worker -> gpu
  kStepResult = 4,   // gpu -> worker
  kError = 5,        // either way
};
const char* MsgTypeName(MsgType t);

// Sampling parameters as they travel (see model/sampling.h for meanings).
struct WireSampling {
  double temperature = 0.0;
  double top_p = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 0;
  double min_p = 0.0;
  double presence_penalty = 0.0;
  double frequency_penalty = 0.0;
  double repetition_penalty = 1.0;
  int32_t logprobs = -1;  // -1 = none; else top log-probs per emitted token (<= kMaxWireTopLogprobs)
  int32_t num_bias = 0;   // logit-bias pairs of this entry in `biases` (<= kMaxWireBias)
  int32_t grammar_bytes = 0;  // bytes of this entry's grammar spec in `grammars` (0 = unconstrained)
};

// One logit-bias pair and one log-prob as they travel.
struct WireBias {
  int32_t token = 0;
  float bias = 0.0f;
};
struct WireLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// StepEntry::flags
inline constexpr uint32_t kEntryOpen = 1u << 0;    // first appearance: create the sequence with `sampling`
inline constexpr uint32_t kEntrySample = 1u << 1;  // sample a token from the last row's logits
inline constexpr uint32_t kEntryLogits = 1u << 2;  // also return the last row's logits (needs logits_rows)

// One sequence's part of a StepRequest; its tokens follow the previous entries' in `tokens`.
// Speculative entries (drafts > 0 or model_drafts > 0) need kEntrySample, and neither kEntryLogits nor
// kEntryOpen; at most one of the two is non-zero. Their step costs num_tokens + model_drafts rows.
struct StepEntry {
  int64_t seq = 0;         // the worker's key for the sequence (unique among its open sequences)
  int32_t num_tokens = 0;  // >= 1
  uint32_t flags = 0;
  WireSampling sampling;   // read with kEntryOpen
  int32_t drafts = 0;        // the last `drafts` tokens are proposals to verify (< num_tokens; needs verify)
  int32_t model_drafts = 0;  // numoe-gpu's drafter proposes this many after the single token (num_tokens 1;
                             // <= Geometry::max_model_drafts)
};

// One fork of a StepRequest: `seq` (a new key) starts as a copy of open sequence `parent`.
struct WireFork {
  int64_t seq = 0;
  int64_t parent = 0;
  WireSampling sampling;
};

// The fixed header of a message; which fields mean something depends on `type`.
struct MsgHeader {
  uint32_t type = 0;         // MsgType
  uint32_t status_code = 0;  // kError: absl::StatusCode
  uint64_t seq = 0;          // message number in this direction, 1, 2, ...
  int64_t layer = 0;         // kMoeRequest / kMoeResponse
  int64_t rows = 0;          // kMoeRequest / kMoeResponse
  int64_t top_k = 0;         // kMoeRequest
  int64_t num_entries = 0;   // kStepRequest / kStepResult
  int64_t num_tokens = 0;    // kStepRequest
  int64_t num_releases = 0;  // kStepRequest: sequences to free before the step runs
  int64_t num_forks = 0;     // kStepRequest: forks to make before the releases and the step
  int64_t num_biases = 0;    // kStepRequest: logit-bias pairs in biases (num_bias over forks and opening entries)
  int64_t num_grammar_bytes = 0;  // kStepRequest: bytes in grammars (grammar_bytes over the opening entries)
  int64_t num_logprobs = 0;  // kStepResult: rows written in logprobs (0 or num_emitted)
  int64_t num_logits = 0;    // kStepResult: rows in logits (entries with kEntryLogits, in order)
  int64_t num_emitted = 0;   // kStepResult: tokens in emitted (the sum of counts)
  int64_t compute_ns = 0;    // kMoeResponse: time the worker spent computing (hop overhead = RTT - this)
  // kStepResult: numoe-gpu's prefix cache (gpu_service/session.h): bytes its first tier's checkpoints hold
  // (-1: off), and the prompt tokens its lookups queried and restored since it started; its host tier's bytes
  // (-1: no host tier), and the checkpoints evicted from each tier since it started.
  int64_t prefix_cache_bytes = -1;
  int64_t prefix_queried_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_host_bytes = -1;
  int64_t prefix_evicted = 0;
  int64_t prefix_host_evicted = 0;
  int64_t text_len = 0;      // kError
};

enum class Side { kGpu, kWorker };

namespace internal {
struct Header;    // region header (shm_channel.cc)
struct Doorbell;  // one direction's counters (shm_channel.cc)
}  // namespace internal

struct ChannelOptions {
  int spin_us = 50;   // busy-poll this long before sleeping on the futex
  int poll_ms = 20;   // futex sleep slice: peer liveness and deadlines are checked this often
};

class Channel {
 public:
  // Creates a named POSIX shared-memory object (shm_open, O_EXCL; name like "/numoe-123-1") and maps it.
  // The creator is Side::kGpu. Unlink() removes the name once the peer has attached.
  static StatusOr<std::unique_ptr<Channel>> Create(const std::string& name, const Geometry& geometry,
                                                   const ChannelOptions& options = {});
  // An unnamed channel (memfd): for two threads of one process, or two processes after fork()
  // (the child calls BindAfterFork(Side::kWorker)).
  static StatusOr<std::unique_ptr<Channel>> CreateAnonymous(const Geometry& geometry,
                                                            const ChannelOptions& options = {});
  // Opens and maps a channel created by Create(), validates magic, version, geometry and size (errors
  // name the field), and registers this process as the worker side.
  static StatusOr<std::unique_ptr<Channel>> Attach(const std::string& name, const ChannelOptions& options = {});

  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  // The other endpoint of this channel in the same process (shares the mapping, which lives until both
  // endpoints are gone).
  StatusOr<std::unique_ptr<Channel>> PeerEndpoint() const;
  // After fork(): this copy becomes `side` and records this process's pid.
  void BindAfterFork(Side side);

  // Removes the shared-memory name (existing mappings stay valid). Idempotent.
  Status Unlink();
  // The same for a name this process did not create: the worker removes the name as soon as it has
  // attached, so nothing is left in /dev/shm even if numoe-gpu is killed. A missing name is not an error.
  static Status RemoveName(const std::string& name);

  Side side() const { return side_; }
  const Geometry& geometry() const { return geometry_; }
  const Layout& layout() const { return layout_; }
  const std::string& name() const { return name_; }
  size_t bytes() const { return layout_.total; }
  // True once the worker side has attached (its pid is recorded).
  bool peer_attached() const;
  // OK while the peer process lives and has not closed the channel; UNAVAILABLE naming why otherwise.
  // Thread-safe (a watchdog may call it while another thread is in Receive).
  Status PeerStatus() const;

  // ---- messages ----
  // This side's outgoing header: fill it (and the arrays), then Send(). Send sets type and seq.
  MsgHeader& outgoing();
  // The message last returned by Receive() (valid until this side's next Receive).
  const MsgHeader& incoming() const;

  // Publishes the outgoing message. FAILED_PRECONDITION if the peer has not yet received our previous
  // message (protocol misuse), UNAVAILABLE if the channel was closed.
  Status Send(MsgType type);
  // Sends kError carrying `status` (its code and message, truncated to kErrorTextBytes).
  Status SendError(const Status& status);
  // Waits for the peer's next message. timeout_ms < 0: no deadline (the peer's liveness is still
  // checked). Errors: DEADLINE_EXCEEDED, UNAVAILABLE (peer exited or closed), CANCELLED (Interrupt()).
  StatusOr<MsgType> Receive(int64_t timeout_ms = -1);
  // The Status carried by an incoming kError message.
  Status IncomingError() const;

  // Makes a Receive() in progress (or the next one) return CANCELLED; sticky until ClearInterrupt().
  void Interrupt();
  void ClearInterrupt();
  // Marks this side closed and wakes the peer (its Receive returns UNAVAILABLE).
  void Close();

  // ---- arrays (capacities from geometry) ----
  StepEntry* entries() const;   // up: [max_seqs]
  int32_t* tokens() const;      // up: [max_rows]
  int64_t* releases() const;    // up: [max_seqs]
  WireFork* forks() const;      // up: [max_seqs]
  WireBias* biases() const;     // up: [max_seqs x kMaxWireBias]
  char* grammars() const;       // up: [kMaxWireGrammarBytes]
  float* moe_out() const;       // up: [max_rows, hidden]
  float* moe_x() const;         // down: [max_rows, hidden]
  int32_t* moe_ids() const;     // down: [max_rows, top_k]
  float* moe_weights() const;   // down: [max_rows, top_k]
  int32_t* sampled() const;     // down: [max_seqs] the first emitted token per entry (-1: did not sample)
  int32_t* counts() const;      // down: [max_seqs] tokens emitted per entry (0, 1, or 1 + accepted)
  int32_t* drafted() const;     // down: [max_seqs] drafts verified per entry
  int32_t* accepted() const;    // down: [max_seqs] drafts kept per entry
  int32_t* cached() const;      // down: [max_seqs] prompt tokens restored from numoe-gpu's prefix cache
  int32_t* emitted() const;     // down: [max_rows] every entry's emitted tokens, entry after entry
  WireLogprob* logprobs() const;  // down: [max_rows, 1 + kMaxWireTopLogprobs]: chosen, then the top ones
  float* logits() const;        // down: [logits_rows, vocab]

 private:
  using Header = internal::Header;
  using Doorbell = internal::Doorbell;
  Channel() = default;
  static StatusOr<std::unique_ptr<Channel>> MapFd(int fd, size_t bytes, const Geometry* create,
                                                  const ChannelOptions& options);
  Header* header() const;
  Doorbell* inbound() const;
  Doorbell* outbound() const;
  MsgHeader* out_msg() const;
  MsgHeader* in_msg() const;
  char* out_error_text() const;
  const char* in_error_text() const;
  Status CheckPeer();

  std::string name_;
  bool unlinked_ = true;
  uint8_t* base_ = nullptr;
  std::shared_ptr<void> mapping_;  // munmap on last release; shared with PeerEndpoint() aliases
  Geometry geometry_;
  Layout layout_;
  Side side_ = Side::kGpu;
  ChannelOptions options_;
  uint32_t received_ = 0;  // inbound messages consumed
  uint32_t sent_ = 0;      // outbound messages published
  std::atomic<bool> interrupted_{false};
  int peer_pidfd_ = -1;
  int32_t peer_pid_ = 0;
};

}  // namespace numoe::shm
