// FifoMutex hands the lock over in arrival order: a lane that asked first gets the model first.
#include "gpu_service/fifo_mutex.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

namespace numoe::gpu {
namespace {

TEST(FifoMutex, WaitersGetTheLockInArrivalOrder) {
  FifoMutex mu;
  std::vector<int> order;
  std::atomic<int> queued{0};
  mu.lock();
  std::vector<std::thread> threads;
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      queued.fetch_add(1);
      mu.lock();
      order.push_back(i);
      mu.unlock();
    });
    // Let thread i take its ticket before thread i + 1 starts.
    while (queued.load() <= i) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  mu.unlock();
  for (auto& t : threads) t.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3, 4, 5}));
}

TEST(FifoMutex, ExcludesUnderContention) {
  FifoMutex mu;
  int64_t counter = 0;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 20000; ++i) {
        std::lock_guard<FifoMutex> lk(mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 4 * 20000);
}

}  // namespace
}  // namespace numoe::gpu
