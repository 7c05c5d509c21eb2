#include "model/backend.h"

#include <algorithm>
#include <set>

namespace numoe {

HostBytes HostBytes::Heap(int64_t n) {
  HostBytes b;
  b.data = std::shared_ptr<uint8_t[]>(new uint8_t[static_cast<size_t>(std::max<int64_t>(n, 1))]);
  b.size = n;
  return b;
}

Status ValidateSequenceSteps(std::span<const SequenceStep> steps, const ModelConfig& config,
                             const std::function<StatusOr<int64_t>(SequenceId)>& position) {
  if (steps.empty()) return absl::InvalidArgumentError("Forward: empty step");
  std::set<SequenceId> seen;
  for (const SequenceStep& st : steps) {
    ASSIGN_OR_RETURN(const int64_t at, position(st.seq));
    if (!seen.insert(st.seq).second) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", st.seq, " appears twice in one step"));
    }
    if (st.tokens.empty()) return absl::InvalidArgumentError(absl::StrCat("sequence ", st.seq, ": no tokens"));
    const int64_t end = at + static_cast<int64_t>(st.tokens.size());
    if (config.max_position_embeddings > 0 && end > config.max_position_embeddings) {
      return absl::OutOfRangeError(absl::StrCat("sequence ", st.seq, ": ", end, " tokens exceed the context limit of ",
                                                config.max_position_embeddings));
    }
    for (int32_t t : st.tokens) {
      if (t < 0 || t >= config.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", t, " is out of range [0, ", config.vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace numoe
