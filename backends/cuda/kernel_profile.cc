#include "backends/cuda/kernel_profile.h"

#include <cupti.h>
#include <cxxabi.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"

namespace numoe::cuda {
namespace internal {
std::atomic<bool> kernel_profile_active{false};
}  // namespace internal

namespace {

// The CUPTI entry points a profile uses, from the library loaded at run time.
struct Cupti {
  void* lib = nullptr;
  CUptiResult (*register_callbacks)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc) = nullptr;
  CUptiResult (*enable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*disable)(CUpti_ActivityKind) = nullptr;
  CUptiResult (*flush_all)(uint32_t) = nullptr;
  CUptiResult (*next_record)(uint8_t*, size_t, CUpti_Activity**) = nullptr;
  CUptiResult (*push_external)(CUpti_ExternalCorrelationKind, uint64_t) = nullptr;
  CUptiResult (*pop_external)(CUpti_ExternalCorrelationKind, uint64_t*) = nullptr;
  CUptiResult (*result_string)(CUptiResult, const char**) = nullptr;
};

struct Raw {
  std::string name;
  uint64_t start = 0, end = 0;
  uint32_t correlation = 0;
  int32_t gx = 0, gy = 0, gz = 0;
};

std::mutex mu;
Cupti cupti;
std::vector<Raw> raws;                                        // guarded by mu
std::map<uint64_t, std::pair<std::string, int64_t>> notes;    // external id -> note; guarded by mu
std::map<uint32_t, uint64_t> external;                        // CUPTI correlation id -> external id; guarded by mu
uint64_t next_note = 1;                                       // guarded by mu
bool running = false;                                         // guarded by mu

std::string ShortName(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  // "void numoe::cuda::(anonymous namespace)::Kernel<...>(args)" -> "Kernel": template arguments, then the
  // parameters, then the qualification and the return type go.
  std::string out;
  int depth = 0;
  for (char c : s) {
    if (c == '<') ++depth;
    if (depth == 0) out += c;
    if (c == '>' && depth > 0) --depth;
  }
  for (const std::string anon : {"(anonymous namespace)::"}) {
    for (size_t at; (at = out.find(anon)) != std::string::npos;) out.erase(at, anon.size());
  }
  if (const size_t paren = out.find('('); paren != std::string::npos) out.resize(paren);
  if (const size_t colon = out.rfind("::"); colon != std::string::npos) out = out.substr(colon + 2);
  if (const size_t space = out.rfind(' '); space != std::string::npos) out = out.substr(space + 1);
  return out;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  constexpr size_t kBytes = 8 << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = kBytes;
  *max_records = 0;
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::vector<Raw> got;
  std::vector<std::pair<uint32_t, uint64_t>> links;
  while (cupti.next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION) {
      const auto* e = reinterpret_cast<const CUpti_ActivityExternalCorrelation*>(record);
      links.push_back({e->correlationId, e->externalId});
      continue;
    }
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && record->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    got.push_back({ShortName(k->name), k->start, k->end, k->correlationId, k->gridX, k->gridY, k->gridZ});
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(mu);
  raws.insert(raws.end(), got.begin(), got.end());
  for (const auto& [corr, ext] : links) external[corr] = ext;
}

Status Check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return absl::OkStatus();
  const char* text = "unknown error";
  if (cupti.result_string != nullptr) cupti.result_string(r, &text);
  return absl::UnavailableError(absl::StrCat(what, ": ", text));
}

Status Load() {
  if (cupti.lib != nullptr) return absl::OkStatus();
  std::vector<std::string> names;
  if (const char* env = std::getenv("NUMOE_CUPTI"); env != nullptr && *env != '\0') names.push_back(env);
  names.insert(names.end(), {"libcupti.so.13", "libcupti.so", "/usr/local/cuda/lib64/libcupti.so",
                             "/usr/local/cuda/extras/CUPTI/lib64/libcupti.so"});
  std::string tried;
  for (const std::string& n : names) {
    cupti.lib = ::dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (cupti.lib != nullptr) break;
    absl::StrAppend(&tried, tried.empty() ? "" : ", ", n);
  }
  if (cupti.lib == nullptr) {
    return absl::UnavailableError(absl::StrCat("a kernel profile needs CUPTI (libcupti from the CUDA toolkit); none of ",
                                               tried, " loads: set NUMOE_CUPTI to its path"));
  }
  const auto sym = [](const char* name) { return ::dlsym(cupti.lib, name); };
  cupti.register_callbacks = reinterpret_cast<decltype(cupti.register_callbacks)>(sym("cuptiActivityRegisterCallbacks"));
  cupti.enable = reinterpret_cast<decltype(cupti.enable)>(sym("cuptiActivityEnable"));
  cupti.disable = reinterpret_cast<decltype(cupti.disable)>(sym("cuptiActivityDisable"));
  cupti.flush_all = reinterpret_cast<decltype(cupti.flush_all)>(sym("cuptiActivityFlushAll"));
  cupti.next_record = reinterpret_cast<decltype(cupti.next_record)>(sym("cuptiActivityGetNextRecord"));
  cupti.push_external = reinterpret_cast<decltype(cupti.push_external)>(sym("cuptiActivityPushExternalCorrelationId"));
  cupti.pop_external = reinterpret_cast<decltype(cupti.pop_external)>(sym("cuptiActivityPopExternalCorrelationId"));
  cupti.result_string = reinterpret_cast<decltype(cupti.result_string)>(sym("cuptiGetResultString"));
  if (!cupti.register_callbacks || !cupti.enable || !cupti.disable || !cupti.flush_all || !cupti.next_record ||
      !cupti.push_external || !cupti.pop_external) {
    ::dlclose(cupti.lib);
    cupti = Cupti{};
    return absl::UnavailableError("the CUPTI library that loaded lacks the activity API");
  }
  return Check(cupti.register_callbacks(BufferRequested, BufferCompleted), "cuptiActivityRegisterCallbacks");
}

}  // namespace

constexpr CUpti_ExternalCorrelationKind kNoteKind = CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0;

namespace internal {
uint64_t PushNote(std::string what, int64_t bytes) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!running) return 0;
    id = next_note++;
    notes[id] = {std::move(what), bytes};
  }
  return cupti.push_external(kNoteKind, id) == CUPTI_SUCCESS ? id : 0;
}
void PopNote() {
  uint64_t id = 0;
  cupti.pop_external(kNoteKind, &id);
}
}  // namespace internal

Status StartKernelProfile() {
  std::lock_guard<std::mutex> lock(mu);
  if (running) return absl::FailedPreconditionError("a kernel profile is already running");
  RETURN_IF_ERROR(Load());
  raws.clear();
  notes.clear();
  external.clear();
  RETURN_IF_ERROR(Check(cupti.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(kernels)"));
  // External correlation records come with API records: trace the driver and runtime calls too (their records
  // are dropped).
  RETURN_IF_ERROR(Check(cupti.enable(CUPTI_ACTIVITY_KIND_DRIVER), "cuptiActivityEnable(driver)"));
  RETURN_IF_ERROR(Check(cupti.enable(CUPTI_ACTIVITY_KIND_RUNTIME), "cuptiActivityEnable(runtime)"));
  RETURN_IF_ERROR(
      Check(cupti.enable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION), "cuptiActivityEnable(external correlation)"));
  running = true;
  internal::kernel_profile_active = true;
  return absl::OkStatus();
}

StatusOr<std::vector<KernelRecord>> StopKernelProfile() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!running) return absl::FailedPreconditionError("no kernel profile is running");
    internal::kernel_profile_active = false;
    running = false;
  }
  // Flushing calls BufferCompleted, which takes mu.
  RETURN_IF_ERROR(Check(cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll"));
  RETURN_IF_ERROR(Check(cupti.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityDisable(kernels)"));
  RETURN_IF_ERROR(Check(cupti.disable(CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION), "cuptiActivityDisable(external)"));
  RETURN_IF_ERROR(Check(cupti.disable(CUPTI_ACTIVITY_KIND_RUNTIME), "cuptiActivityDisable(runtime)"));
  RETURN_IF_ERROR(Check(cupti.disable(CUPTI_ACTIVITY_KIND_DRIVER), "cuptiActivityDisable(driver)"));
  std::lock_guard<std::mutex> lock(mu);
  std::vector<KernelRecord> out;
  out.reserve(raws.size());
  for (const Raw& r : raws) {
    KernelRecord k{.kernel = r.name, .start_ns = r.start, .end_ns = r.end, .grid_x = r.gx, .grid_y = r.gy, .grid_z = r.gz};
    if (auto e = external.find(r.correlation); e != external.end()) {
      if (auto it = notes.find(e->second); it != notes.end()) {
        k.what = it->second.first;
        k.bytes = it->second.second;
      }
    }
    out.push_back(std::move(k));
  }
  std::sort(out.begin(), out.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  raws.clear();
  notes.clear();
  external.clear();
  return out;
}

}  // namespace numoe::cuda
