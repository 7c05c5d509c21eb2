// numoe-gpu's expert hop over the channel (gpu_service/shm_experts.h) against a worker thread.
#include "gpu_service/shm_experts.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

#include "tests/support/status_matchers.h"

namespace numoe::gpu {
namespace {

// Found by fuzz_gpu_step (UBSan): the worker's compute_ns went into rtt - compute_ns unchecked, so a hostile
// value overflowed. It is clamped to [0, rtt]: a negative one counts as no compute, the hop is the round trip.
TEST(ShmExperts, AHostileComputeTimeIsClamped) {
  const shm::Geometry g{.hidden = 2, .top_k = 1, .max_rows = 2, .max_seqs = 1, .vocab = 4};
  for (int64_t compute_ns : {std::numeric_limits<int64_t>::min() + 511, std::numeric_limits<int64_t>::max()}) {
    auto gpu = shm::Channel::CreateAnonymous(g);
    ASSERT_OK(gpu);
    auto worker = (*gpu)->PeerEndpoint();
    ASSERT_OK(worker);
    LatencyRecorder hops;
    ShmExpertBackend experts(gpu->get(), &hops);
    std::thread w([&] {
      auto t = (*worker)->Receive(5000);
      ASSERT_OK(t);
      ASSERT_EQ(*t, shm::MsgType::kMoeRequest);
      shm::MsgHeader& r = (*worker)->outgoing();
      r.layer = (*worker)->incoming().layer;
      r.rows = (*worker)->incoming().rows;
      r.compute_ns = compute_ns;
      (*worker)->moe_out()[0] = 1.0f;
      (*worker)->moe_out()[1] = 2.0f;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ASSERT_OK((*worker)->Send(shm::MsgType::kMoeResponse));
    });
    std::vector<float> x(2, 0.5f), weights(1, 1.0f), out(2, 0.0f);
    std::vector<int32_t> ids(1, 0);
    ASSERT_OK(experts.RunRouted(MoeRequest{.layer = 3, .rows = 1, .top_k = 1, .x = x.data(), .expert_ids = ids.data(),
                                           .expert_weights = weights.data(), .out = out.data()}));
    w.join();
    EXPECT_EQ(out, (std::vector<float>{1.0f, 2.0f}));
    ASSERT_EQ(hops.count(), 1u);
    const double hop_us = hops.Percentile(50);
    if (compute_ns < 0) {
      EXPECT_GE(hop_us, 2000.0);  // the whole round trip (the worker slept 2 ms)
    } else {
      EXPECT_EQ(hop_us, 0.0);  // all of it was the worker's
    }
  }
}

}  // namespace
}  // namespace numoe::gpu
