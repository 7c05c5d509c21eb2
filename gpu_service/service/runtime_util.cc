#include "gpu_service/service/runtime_util.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/checkpoint.h"

namespace numoe {

namespace {

uint64_t Fnv1a(uint64_t h, const std::string& bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

const char* CheckpointDrafter(const Checkpoint& ckpt) {
  if (ckpt.mtp_stages() == 0) return "none";
  return ckpt.config().dspark_block_size > 0 ? "dspark" : "mtp";
}

StatusOr<std::string> ModelFingerprint(const std::string& model_dir) {
  namespace fs = std::filesystem;
  uint64_t h = 14695981039346656037ull;
  bool any = false;
  for (const char* name : {"config.json", "model.safetensors.index.json"}) {
    std::ifstream in(fs::path(model_dir) / name, std::ios::binary);
    if (!in) continue;
    std::stringstream ss;
    ss << in.rdbuf();
    h = Fnv1a(h, std::string(name) + "\n" + ss.str());
    any = true;
  }
  std::error_code ec;
  const auto single = fs::path(model_dir) / "model.safetensors";
  if (fs::exists(single, ec)) h = Fnv1a(h, absl::StrCat("model.safetensors:", fs::file_size(single, ec)));
  if (!any) return absl::NotFoundError(absl::StrCat(model_dir, ": no config.json to fingerprint"));
  return absl::StrCat(absl::Hex(h, absl::kZeroPad16));
}

grpc::Status ToGrpcStatus(const Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

Status FromGrpcStatus(const grpc::Status& status, const std::string& what) {
  if (status.ok()) return absl::OkStatus();
  return Status(static_cast<absl::StatusCode>(status.error_code()), absl::StrCat(what, ": ", status.error_message()));
}

void NotifyReady(const std::string& text) {
  const char* env = std::getenv("NUMOE_NOTIFY_FD");
  if (env == nullptr) return;
  char* end = nullptr;
  const long fd = std::strtol(env, &end, 10);
  if (end == env || fd < 0) return;
  const std::string line = "READY " + text + "\n";
  ssize_t unused = write(static_cast<int>(fd), line.data(), line.size());
  (void)unused;
  close(static_cast<int>(fd));
  unsetenv("NUMOE_NOTIFY_FD");
}

void BlockShutdownSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForShutdownSignal(const std::function<bool()>& give_up, int poll_ms) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  const timespec ts{poll_ms / 1000, (poll_ms % 1000) * 1000000L};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig > 0) return sig;
    if (give_up && give_up()) return 0;
  }
}

}  // namespace numoe
