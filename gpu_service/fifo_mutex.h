// A mutex that hands the lock over in arrival order (a ticket lock on a condition variable). numoe-gpu's
// worker sessions take turns on the one model with it: with steps that interleave at their expert calls
// (Capabilities::interleaved_steps), every lane gets the model back in the order it asked, so no worker's
// step starves behind the others'. Meets Lockable (std::unique_lock / lock_guard work).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace numoe::gpu {

class FifoMutex {
 public:
  void lock() {
    std::unique_lock<std::mutex> lk(mu_);
    const uint64_t ticket = next_ticket_++;
    cv_.wait(lk, [&] { return serving_ == ticket; });
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      ++serving_;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_ticket_ = 0;
  uint64_t serving_ = 0;
};

}  // namespace numoe::gpu
