#include "gpu_service/model/spec.h"

#include <algorithm>

namespace numoe {

const char* SpecMethodName(SpecMethod m) {
  switch (m) {
    case SpecMethod::kNone: return "none";
    case SpecMethod::kDspark: return "dspark";
    case SpecMethod::kMtp: return "mtp";
    case SpecMethod::kNgram: return "ngram";
  }
  return "?";
}

StatusOr<SpecMethod> ParseSpecMethod(const std::string& name) {
  for (SpecMethod m : {SpecMethod::kNone, SpecMethod::kDspark, SpecMethod::kMtp, SpecMethod::kNgram}) {
    if (name == SpecMethodName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat("--spec: '", name, "' is not one of none, dspark, mtp, ngram"));
}

Status ValidateSpec(const SpecConfig& c) {
  if (c.depth < 1 || c.depth > 16) {
    return absl::InvalidArgumentError(absl::StrCat("spec depth must be in [1, 16] (got ", c.depth, ")"));
  }
  if (c.ngram_min < 1 || c.ngram_max < c.ngram_min) {
    return absl::InvalidArgumentError("n-gram drafter: need 1 <= ngram_min <= ngram_max");
  }
  return absl::OkStatus();
}

std::vector<int32_t> NgramPropose(std::span<const int32_t> history, int64_t depth, int ngram_max, int ngram_min) {
  const int64_t n = static_cast<int64_t>(history.size());
  for (int64_t len = std::min<int64_t>(ngram_max, n - 1); len >= ngram_min; --len) {
    const int32_t* suffix = history.data() + n - len;
    // Most recent earlier occurrence (its continuation must exist).
    for (int64_t start = n - len - 1; start >= 0; --start) {
      if (!std::equal(suffix, suffix + len, history.data() + start)) continue;
      std::vector<int32_t> out;
      for (int64_t i = start + len; i < n && static_cast<int64_t>(out.size()) < depth; ++i) out.push_back(history[i]);
      return out;
    }
  }
  return {};
}

}  // namespace numoe
