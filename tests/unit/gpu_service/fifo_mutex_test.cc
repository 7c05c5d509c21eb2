// FifoMutex hands the lock over in arrival order: a lane that asked first gets the model first; a background
// waiter (a prefill lane) lets the lock() callers waiting go first, but not forever.
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

// A background waiter that arrived first goes after the lock() waiters queued behind it (at most
// kBackgroundPasses of them), and takes it at once when nobody else waits.
TEST(FifoMutex, BackgroundWaitersMakeWayButNotForever) {
  FifoMutex mu;
  std::vector<int> order;  // -1: the background waiter
  std::atomic<int> queued{0};
  mu.lock();
  std::vector<std::thread> threads;
  auto start = [&](int id, bool background) {
    threads.emplace_back([&, id, background] {
      queued.fetch_add(1);
      if (background) {
        mu.lock_background();
      } else {
        mu.lock();
      }
      order.push_back(id);
      mu.unlock();
    });
    while (queued.load() < static_cast<int>(threads.size())) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  start(-1, true);
  for (int i = 0; i < FifoMutex::kBackgroundPasses + 2; ++i) start(i, false);
  mu.unlock();
  for (auto& t : threads) t.join();
  std::vector<int> want;
  for (int i = 0; i < FifoMutex::kBackgroundPasses; ++i) want.push_back(i);
  want.push_back(-1);
  for (int i = FifoMutex::kBackgroundPasses; i < FifoMutex::kBackgroundPasses + 2; ++i) want.push_back(i);
  EXPECT_EQ(order, want);
  // Alone, it takes the lock at once.
  mu.lock_background();
  mu.unlock();
}

}  // namespace
}  // namespace numoe::gpu
