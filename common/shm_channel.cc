#include "common/shm_channel.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"

namespace numoe::shm {

// ---- shared structures (live in the mapping; plain data + lock-free atomics only) ----

namespace internal {

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;  // sizeof(Header): catches builds with different layouts
  uint64_t total_bytes;
  Geometry geometry;
  std::atomic<int32_t> gpu_pid;
  std::atomic<int32_t> worker_pid;
  std::atomic<uint32_t> gpu_closed;
  std::atomic<uint32_t> worker_closed;
};

struct alignas(64) Doorbell {
  std::atomic<uint32_t> posted;    // messages published in this direction (the futex word)
  std::atomic<uint32_t> consumed;  // messages the receiver has taken
  std::atomic<uint32_t> waiting;   // the receiver is in (or entering) FUTEX_WAIT
};

}  // namespace internal

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

namespace {

constexpr size_t kAlign = 64;
constexpr int64_t kPureSpinNs = 1000;  // spin without yielding this long first
size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

long Futex(std::atomic<uint32_t>* word, int op, uint32_t val, const timespec* timeout) {
  // Shared (not FUTEX_PRIVATE_FLAG): the word lives in a MAP_SHARED mapping used by two processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, val, timeout, nullptr, 0);
}

void WakeAll(std::atomic<uint32_t>* word) { Futex(word, FUTEX_WAKE, INT32_MAX, nullptr); }

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

Status ErrnoError(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

// ---- geometry and layout ----

Status ValidateGeometry(const Geometry& g) {
  auto range = [](const char* field, uint64_t v, uint64_t lo, uint64_t hi) -> Status {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat("shm geometry: ", field, " must be in [", lo, ", ", hi, "] (got ", v, ")"));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(range("hidden", g.hidden, 1, 65536));
  RETURN_IF_ERROR(range("top_k", g.top_k, 1, 64));
  RETURN_IF_ERROR(range("max_rows", g.max_rows, 1, 65536));
  RETURN_IF_ERROR(range("max_seqs", g.max_seqs, 1, 4096));
  RETURN_IF_ERROR(range("vocab", g.vocab, 1, 1u << 24));
  RETURN_IF_ERROR(range("logits_rows", g.logits_rows, 0, g.max_seqs));
  const bool model_drafter = g.drafter != SpecMethod::kNone;
  RETURN_IF_ERROR(range("drafter", static_cast<uint32_t>(g.drafter), static_cast<uint32_t>(SpecMethod::kNone),
                        static_cast<uint32_t>(SpecMethod::kMtp)));
  RETURN_IF_ERROR(range("max_model_drafts", g.max_model_drafts, 0, model_drafter ? 4096 : 0));
  RETURN_IF_ERROR(range("verify", g.verify, model_drafter ? 1 : 0, 1));
  RETURN_IF_ERROR(range("fork", g.fork, 0, 1));
  const size_t total = ComputeLayout(g).total;
  if (total > (size_t{16} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("shm geometry: the region would need ", total,
                                                   " bytes (more than 16 GiB); lower max_rows or logits_rows"));
  }
  return absl::OkStatus();
}

Layout ComputeLayout(const Geometry& g) {
  Layout l;
  size_t at = 0;
  auto take = [&](size_t* field, size_t bytes) {
    *field = at;
    at = AlignUp(at + bytes);
  };
  const size_t rows = g.max_rows, D = g.hidden, K = g.top_k, S = g.max_seqs;
  take(&l.header, sizeof(internal::Header));
  take(&l.to_gpu, sizeof(internal::Doorbell));
  take(&l.to_worker, sizeof(internal::Doorbell));
  take(&l.up_msg, sizeof(MsgHeader));
  take(&l.entries, S * sizeof(StepEntry));
  take(&l.tokens, rows * sizeof(int32_t));
  take(&l.releases, S * sizeof(int64_t));
  take(&l.forks, S * sizeof(WireFork));
  take(&l.biases, S * kMaxWireBias * sizeof(WireBias));
  take(&l.grammars, kMaxWireGrammarBytes);
  take(&l.moe_out, rows * D * sizeof(float));
  take(&l.up_error, kErrorTextBytes);
  take(&l.down_msg, sizeof(MsgHeader));
  take(&l.moe_x, rows * D * sizeof(float));
  take(&l.moe_ids, rows * K * sizeof(int32_t));
  take(&l.moe_weights, rows * K * sizeof(float));
  take(&l.sampled, S * sizeof(int32_t));
  take(&l.counts, S * sizeof(int32_t));
  take(&l.drafted, S * sizeof(int32_t));
  take(&l.accepted, S * sizeof(int32_t));
  take(&l.cached, S * sizeof(int32_t));
  take(&l.emitted, rows * sizeof(int32_t));
  take(&l.logprobs, rows * (1 + kMaxWireTopLogprobs) * sizeof(WireLogprob));
  take(&l.logits, size_t{g.logits_rows} * g.vocab * sizeof(float));
  take(&l.down_error, kErrorTextBytes);
  l.total = at;
  return l;
}

const char* MsgTypeName(MsgType t) {
  switch (t) {
    case MsgType::kNone: return "none";
    case MsgType::kStepRequest: return "StepRequest";
    case MsgType::kMoeRequest: return "MoeRequest";
    case MsgType::kMoeResponse: return "MoeResponse";
    case MsgType::kStepResult: return "StepResult";
    case MsgType::kError: return "Error";
  }
  return "unknown";
}

// ---- mapping ----

StatusOr<std::unique_ptr<Channel>> Channel::MapFd(int fd, size_t bytes, const Geometry* create,
                                                  const ChannelOptions& options) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(absl::StrCat("shm: mmap of ", bytes, " bytes"));
  auto ch = std::unique_ptr<Channel>(new Channel());
  ch->base_ = static_cast<uint8_t*>(p);
  ch->mapping_ = std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, bytes); });
  ch->options_ = options;
  if (create != nullptr) {
    ch->geometry_ = *create;
    ch->layout_ = ComputeLayout(*create);
    Header* h = new (ch->base_ + ch->layout_.header) Header();
    new (ch->base_ + ch->layout_.to_gpu) Doorbell();
    new (ch->base_ + ch->layout_.to_worker) Doorbell();
    h->version = kVersion;
    h->header_bytes = sizeof(Header);
    h->total_bytes = ch->layout_.total;
    h->geometry = *create;
    h->gpu_pid.store(static_cast<int32_t>(getpid()));
    // The magic goes last: an attacher that sees it sees a fully written header.
    std::atomic_thread_fence(std::memory_order_release);
    h->magic = kMagic;
  }
  return ch;
}

StatusOr<std::unique_ptr<Channel>> Channel::Create(const std::string& name, const Geometry& geometry,
                                                   const ChannelOptions& options) {
  RETURN_IF_ERROR(ValidateGeometry(geometry));
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm: channel name '", name, "' must look like /name (one leading slash, no others)"));
  }
  const size_t bytes = ComputeLayout(geometry).total;
  int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return ErrnoError(absl::StrCat("shm: shm_open(", name, ")"));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    Status st = ErrnoError(absl::StrCat("shm: ftruncate(", name, ", ", bytes, ")"));
    close(fd);
    shm_unlink(name.c_str());
    return st;
  }
  auto ch = MapFd(fd, bytes, &geometry, options);
  close(fd);
  if (!ch.ok()) {
    shm_unlink(name.c_str());
    return ch.status();
  }
  (*ch)->name_ = name;
  (*ch)->unlinked_ = false;
  (*ch)->side_ = Side::kGpu;
  return ch;
}

StatusOr<std::unique_ptr<Channel>> Channel::CreateAnonymous(const Geometry& geometry,
                                                            const ChannelOptions& options) {
  RETURN_IF_ERROR(ValidateGeometry(geometry));
  const size_t bytes = ComputeLayout(geometry).total;
  int fd = memfd_create("numoe-channel", MFD_CLOEXEC);
  if (fd < 0) return ErrnoError("shm: memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    Status st = ErrnoError("shm: ftruncate(memfd)");
    close(fd);
    return st;
  }
  auto ch = MapFd(fd, bytes, &geometry, options);
  close(fd);
  if (!ch.ok()) return ch.status();
  (*ch)->side_ = Side::kGpu;
  return ch;
}

StatusOr<std::unique_ptr<Channel>> Channel::Attach(const std::string& name, const ChannelOptions& options) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("shm: cannot open channel ", name, ": ", std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    Status s = ErrnoError(absl::StrCat("shm: fstat(", name, ")"));
    close(fd);
    return s;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < sizeof(Header)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("shm: channel ", name, " is ", size, " bytes, smaller than its header"));
  }
  auto mapped = MapFd(fd, size, nullptr, options);
  close(fd);
  if (!mapped.ok()) return mapped.status();
  std::unique_ptr<Channel> ch = std::move(*mapped);
  ch->name_ = name;
  ch->unlinked_ = true;  // the creator owns the name
  const Header* h = reinterpret_cast<const Header*>(ch->base_);
  auto bad = [&](const std::string& what) {
    return absl::FailedPreconditionError(absl::StrCat("shm: channel ", name, ": ", what));
  };
  if (h->magic != kMagic) return bad(absl::StrCat("bad magic 0x", absl::Hex(h->magic), " (not a numoe channel)"));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (h->version != kVersion) {
    return bad(absl::StrCat("protocol version ", h->version, ", this build speaks ", kVersion));
  }
  if (h->header_bytes != sizeof(Header)) {
    return bad(absl::StrCat("header_bytes ", h->header_bytes, " != ", sizeof(Header), " (different builds)"));
  }
  RETURN_IF_ERROR(ValidateGeometry(h->geometry));
  const Layout layout = ComputeLayout(h->geometry);
  if (h->total_bytes != layout.total || size < layout.total) {
    return bad(absl::StrCat("total_bytes ", h->total_bytes, " / file size ", size, " do not match the geometry (",
                            layout.total, " bytes)"));
  }
  ch->geometry_ = h->geometry;
  ch->layout_ = layout;
  ch->side_ = Side::kWorker;
  ch->header()->worker_pid.store(static_cast<int32_t>(getpid()));
  return ch;
}

StatusOr<std::unique_ptr<Channel>> Channel::PeerEndpoint() const {
  auto ch = std::unique_ptr<Channel>(new Channel());
  ch->base_ = base_;
  ch->mapping_ = mapping_;
  ch->geometry_ = geometry_;
  ch->layout_ = layout_;
  ch->options_ = options_;
  ch->side_ = side_ == Side::kGpu ? Side::kWorker : Side::kGpu;
  ch->unlinked_ = true;
  Header* h = header();
  (ch->side_ == Side::kWorker ? h->worker_pid : h->gpu_pid).store(static_cast<int32_t>(getpid()));
  return ch;
}

void Channel::BindAfterFork(Side side) {
  side_ = side;
  if (peer_pidfd_ >= 0) close(peer_pidfd_);
  peer_pidfd_ = -1;
  peer_pid_ = 0;
  unlinked_ = true;  // only the creating process removes the name
  (side == Side::kWorker ? header()->worker_pid : header()->gpu_pid).store(static_cast<int32_t>(getpid()));
}

Channel::~Channel() {
  if (peer_pidfd_ >= 0) close(peer_pidfd_);
  if (base_ != nullptr) Close();
  if (!unlinked_) (void)Unlink();
}

Status Channel::Unlink() {
  if (unlinked_) return absl::OkStatus();
  unlinked_ = true;
  if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT) return ErrnoError(absl::StrCat("shm_unlink(", name_, ")"));
  return absl::OkStatus();
}

Status Channel::RemoveName(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) return ErrnoError(absl::StrCat("shm_unlink(", name, ")"));
  return absl::OkStatus();
}

// ---- accessors ----

Channel::Header* Channel::header() const { return reinterpret_cast<Header*>(base_ + layout_.header); }
Channel::Doorbell* Channel::inbound() const {
  return reinterpret_cast<Doorbell*>(base_ + (side_ == Side::kGpu ? layout_.to_gpu : layout_.to_worker));
}
Channel::Doorbell* Channel::outbound() const {
  return reinterpret_cast<Doorbell*>(base_ + (side_ == Side::kGpu ? layout_.to_worker : layout_.to_gpu));
}
MsgHeader* Channel::out_msg() const {
  return reinterpret_cast<MsgHeader*>(base_ + (side_ == Side::kGpu ? layout_.down_msg : layout_.up_msg));
}
MsgHeader* Channel::in_msg() const {
  return reinterpret_cast<MsgHeader*>(base_ + (side_ == Side::kGpu ? layout_.up_msg : layout_.down_msg));
}
char* Channel::out_error_text() const {
  return reinterpret_cast<char*>(base_ + (side_ == Side::kGpu ? layout_.down_error : layout_.up_error));
}
const char* Channel::in_error_text() const {
  return reinterpret_cast<const char*>(base_ + (side_ == Side::kGpu ? layout_.up_error : layout_.down_error));
}
MsgHeader& Channel::outgoing() { return *out_msg(); }
const MsgHeader& Channel::incoming() const { return *in_msg(); }
bool Channel::peer_attached() const { return header()->worker_pid.load() != 0; }

StepEntry* Channel::entries() const { return reinterpret_cast<StepEntry*>(base_ + layout_.entries); }
int32_t* Channel::tokens() const { return reinterpret_cast<int32_t*>(base_ + layout_.tokens); }
int64_t* Channel::releases() const { return reinterpret_cast<int64_t*>(base_ + layout_.releases); }
WireFork* Channel::forks() const { return reinterpret_cast<WireFork*>(base_ + layout_.forks); }
WireBias* Channel::biases() const { return reinterpret_cast<WireBias*>(base_ + layout_.biases); }
char* Channel::grammars() const { return reinterpret_cast<char*>(base_ + layout_.grammars); }
float* Channel::moe_out() const { return reinterpret_cast<float*>(base_ + layout_.moe_out); }
float* Channel::moe_x() const { return reinterpret_cast<float*>(base_ + layout_.moe_x); }
int32_t* Channel::moe_ids() const { return reinterpret_cast<int32_t*>(base_ + layout_.moe_ids); }
float* Channel::moe_weights() const { return reinterpret_cast<float*>(base_ + layout_.moe_weights); }
int32_t* Channel::sampled() const { return reinterpret_cast<int32_t*>(base_ + layout_.sampled); }
int32_t* Channel::counts() const { return reinterpret_cast<int32_t*>(base_ + layout_.counts); }
int32_t* Channel::drafted() const { return reinterpret_cast<int32_t*>(base_ + layout_.drafted); }
int32_t* Channel::accepted() const { return reinterpret_cast<int32_t*>(base_ + layout_.accepted); }
int32_t* Channel::cached() const { return reinterpret_cast<int32_t*>(base_ + layout_.cached); }
int32_t* Channel::emitted() const { return reinterpret_cast<int32_t*>(base_ + layout_.emitted); }
WireLogprob* Channel::logprobs() const { return reinterpret_cast<WireLogprob*>(base_ + layout_.logprobs); }
float* Channel::logits() const { return reinterpret_cast<float*>(base_ + layout_.logits); }

// ---- the doorbell ----

Status Channel::Send(MsgType type) {
  Header* h = header();
  if ((side_ == Side::kGpu ? h->gpu_closed : h->worker_closed).load() != 0) {
    return absl::UnavailableError("shm: this side of the channel is closed");
  }
  Doorbell* out = outbound();
  if (out->consumed.load(std::memory_order_acquire) != sent_) {
    return absl::FailedPreconditionError(
        absl::StrCat("shm: cannot send ", MsgTypeName(type), ": the peer has not received message ", sent_));
  }
  MsgHeader* m = out_msg();
  m->type = static_cast<uint32_t>(type);
  m->seq = ++sent_;
  // seq_cst pairs with the receiver's store to `waiting` then re-load of `posted`: either it sees the
  // new count, or we see it waiting and wake it.
  out->posted.store(sent_, std::memory_order_seq_cst);
  if (out->waiting.load(std::memory_order_seq_cst) != 0) WakeAll(&out->posted);
  return absl::OkStatus();
}

Status Channel::SendError(const Status& status) {
  MsgHeader& m = outgoing();
  m.status_code = static_cast<uint32_t>(status.code());
  const absl::string_view text = status.message();
  const size_t n = std::min(text.size(), kErrorTextBytes - 1);
  if (n > 0) std::memcpy(out_error_text(), text.data(), n);  // an empty message's data() may be null
  out_error_text()[n] = '\0';
  m.text_len = static_cast<int64_t>(n);
  return Send(MsgType::kError);
}

Status Channel::IncomingError() const {
  const MsgHeader& m = incoming();
  const size_t n = std::min<size_t>(static_cast<size_t>(std::max<int64_t>(m.text_len, 0)), kErrorTextBytes - 1);
  auto code = static_cast<absl::StatusCode>(m.status_code);
  if (code == absl::StatusCode::kOk) code = absl::StatusCode::kUnknown;
  return Status(code, std::string(in_error_text(), n));
}

Status Channel::CheckPeer() {
  Header* h = header();
  if ((side_ == Side::kGpu ? h->worker_closed : h->gpu_closed).load() != 0) {
    return absl::UnavailableError(
        absl::StrCat("shm: the ", side_ == Side::kGpu ? "worker" : "gpu service", " closed the channel"));
  }
  const int32_t pid = (side_ == Side::kGpu ? h->worker_pid : h->gpu_pid).load();
  if (pid == 0 || pid == getpid()) return absl::OkStatus();  // not attached yet, or a thread of ours
  if (pid != peer_pid_) {
    if (peer_pidfd_ >= 0) close(peer_pidfd_);
    peer_pid_ = pid;
    peer_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (peer_pidfd_ < 0 && errno == ESRCH) {
      return absl::UnavailableError(absl::StrCat("shm: peer process ", pid, " has exited"));
    }
  }
  bool dead = false;
  if (peer_pidfd_ >= 0) {
    // A pidfd polls readable once the process has terminated (zombies included, and no pid reuse).
    pollfd p{peer_pidfd_, POLLIN, 0};
    dead = poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0;
  } else {
    dead = kill(pid, 0) != 0 && errno == ESRCH;
  }
  if (dead) return absl::UnavailableError(absl::StrCat("shm: peer process ", pid, " has exited"));
  return absl::OkStatus();
}

Status Channel::PeerStatus() const {
  Header* h = header();
  if ((side_ == Side::kGpu ? h->worker_closed : h->gpu_closed).load() != 0) {
    return absl::UnavailableError(
        absl::StrCat("shm: the ", side_ == Side::kGpu ? "worker" : "gpu service", " closed the channel"));
  }
  const int32_t pid = (side_ == Side::kGpu ? h->worker_pid : h->gpu_pid).load();
  if (pid == 0 || pid == getpid()) return absl::OkStatus();
  const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  bool dead;
  if (fd >= 0) {
    pollfd p{fd, POLLIN, 0};
    dead = poll(&p, 1, 0) > 0;
    close(fd);
  } else {
    dead = errno == ESRCH || (kill(pid, 0) != 0 && errno == ESRCH);
  }
  if (dead) return absl::UnavailableError(absl::StrCat("shm: peer process ", pid, " has exited"));
  return absl::OkStatus();
}

StatusOr<MsgType> Channel::Receive(int64_t timeout_ms) {
  Doorbell* in = inbound();
  const uint32_t last = received_;
  const int64_t start = SteadyNanos();
  const int64_t deadline = timeout_ms < 0 ? INT64_MAX : start + timeout_ms * 1'000'000;
  auto arrived = [&] { return in->posted.load(std::memory_order_acquire) != last; };

  // Phase 1: spin (a reply usually comes within microseconds). Check the clock every 64 polls; past the
  // first few microseconds also yield then, so a peer sharing our core (oversubscribed machine, unpinned
  // processes) gets to run instead of waiting out the whole spin.
  const int64_t spin_end = start + int64_t{options_.spin_us} * 1000;
  const int64_t yield_after = start + kPureSpinNs;
  bool got = false;
  for (int i = 0; !(got = arrived()); ++i) {
    CpuRelax();
    if ((i & 63) == 63) {
      const int64_t now = SteadyNanos();
      if (now >= spin_end) break;
      if (now >= yield_after) sched_yield();
    }
  }
  // Phase 2: sleep on the futex in slices; between slices check the peer, the deadline, interrupts.
  while (!got) {
    if (interrupted_.load()) return absl::CancelledError("shm: receive interrupted");
    RETURN_IF_ERROR(CheckPeer());
    const int64_t now = SteadyNanos();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("shm: no message from the peer within ", timeout_ms, " ms"));
    }
    const int64_t slice = std::min<int64_t>(deadline - now, int64_t{options_.poll_ms} * 1'000'000);
    timespec ts{static_cast<time_t>(slice / 1'000'000'000), static_cast<long>(slice % 1'000'000'000)};
    in->waiting.store(1, std::memory_order_seq_cst);
    if (!(got = arrived())) Futex(&in->posted, FUTEX_WAIT, last, &ts);
    in->waiting.store(0, std::memory_order_relaxed);
    got = got || arrived();
  }
  const uint32_t posted = in->posted.load(std::memory_order_acquire);
  if (posted != last + 1) {
    return absl::DataLossError(absl::StrCat("shm: message sequence jumped from ", last, " to ", posted));
  }
  received_ = posted;
  const MsgHeader* m = in_msg();
  if (m->seq != posted) {
    return absl::DataLossError(absl::StrCat("shm: message header seq ", m->seq, " != doorbell ", posted));
  }
  in->consumed.store(posted, std::memory_order_release);
  const uint32_t type = m->type;
  if (type < static_cast<uint32_t>(MsgType::kStepRequest) || type > static_cast<uint32_t>(MsgType::kError)) {
    return absl::DataLossError(absl::StrCat("shm: unknown message type ", type));
  }
  return static_cast<MsgType>(type);
}

void Channel::Interrupt() {
  interrupted_.store(true);
  WakeAll(&inbound()->posted);
}

void Channel::ClearInterrupt() { interrupted_.store(false); }

void Channel::Close() {
  Header* h = header();
  (side_ == Side::kGpu ? h->gpu_closed : h->worker_closed).store(1);
  WakeAll(&outbound()->posted);  // the peer wakes, sees no new message, checks our closed flag
}

}  // namespace numoe::shm
