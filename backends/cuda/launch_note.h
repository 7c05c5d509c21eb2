// The launchers' half of a kernel profile (kernel_profile.h): a note on what a launch moves. No absl here, so
// the .cu files include it.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace numoe::cuda {

namespace internal {
extern std::atomic<bool> kernel_profile_active;
uint64_t PushNote(std::string what, int64_t bytes);  // returns the id it pushed (0: none)
void PopNote();
}  // namespace internal

// Wraps a launcher's enqueueing of a kernel while a profile runs: the kernels launched in its lifetime get its
// note (CUPTI external correlation). Free when no profile runs: the note is not even built (pass a callable).
class LaunchNote {
 public:
  template <typename MakeNote>
  LaunchNote(int64_t bytes, MakeNote&& make_note) {
    if (internal::kernel_profile_active.load(std::memory_order_relaxed)) id_ = internal::PushNote(make_note(), bytes);
  }
  LaunchNote(const LaunchNote&) = delete;
  LaunchNote& operator=(const LaunchNote&) = delete;
  ~LaunchNote() {
    if (id_ != 0) internal::PopNote();
  }

 private:
  uint64_t id_ = 0;
};

}  // namespace numoe::cuda
