// A mutex that hands the lock over in arrival order (a ticket lock on a condition variable). numoe-gpu's
// worker sessions take turns on the one model with it: with steps that interleave at their expert calls
// (Capabilities::interleaved_steps), every lane gets the model back in the order it asked, so no worker's
// step starves behind the others'. Meets Lockable (std::unique_lock / lock_guard work).
//
// lock_background() is for work that should make way (a worker's prefill lane): it takes the lock when it is
// free and no lock() caller waits, or once kBackgroundPasses lock() callers took it while it waited, so a
// background holder still gets a turn on a busy model.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace numoe::gpu {

class FifoMutex {
 public:
  static constexpr int64_t kBackgroundPasses = 4;

  void lock() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t ticket = next_ticket_++;
    cv_.wait(lk, [&] { return !held_ && serving_ == ticket && !background_due(); });
    held_ = true;
    ++serving_;
    if (background_waiting_ > 0) ++passed_;
  }
  void lock_background() {
    std::unique_lock<std::mutex> lk(mu_);
    ++background_waiting_;
    cv_.wait(lk, [&] { return !held_ && (serving_ == next_ticket_ || background_due()); });
    --background_waiting_;
    held_ = true;
    passed_ = 0;
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      held_ = false;
    }
    cv_.notify_all();
  }

 private:
  bool background_due() const { return background_waiting_ > 0 && passed_ >= kBackgroundPasses; }

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;  // the next lock() ticket to take it
  bool held_ = false;
  int64_t background_waiting_ = 0;
  int64_t passed_ = 0;  // lock() acquisitions since a background waiter last held it
};

}  // namespace numoe::gpu
