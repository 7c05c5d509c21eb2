// GpuServer::Register with a worker's expert arena (GPU prefill), on the CPU backend (no GPU needed): with GPU
// prefill asked for, an arena that does not fit the model is refused naming the field, before any channel
// exists; a good one is mapped (the answer says gpu_prefill) and the session, whose backend cannot attach it,
// turns GPU prefill off and serves on; with --gpu-prefill-threshold 0 the arena is not even looked at.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "backends/cpu/cpu_model.h"
#include "common/numa.h"
#include "common/packed_layout.h"
#include "gpu_service/gpu_server.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe::gpu {
namespace {

struct Arena {
  std::unique_ptr<SharedArena> file;
  std::vector<NodeBuffer> layers;
  v1::ExpertArena proto;
};

// A sealed arena of `c`'s shape in this process (the test plays the worker).
Arena MakeArena(const ModelConfig& c) {
  Arena a;
  auto file = SharedArena::Create("numoe-test-arena", 0, /*huge_pages=*/false);
  EXPECT_OK(file);
  a.file = std::move(*file);
  const int64_t stride = experts::PackedExpertShape{c.hidden_size, c.moe_intermediate_size}.stride();
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    int64_t off = -1;
    auto buf = a.file->Allocate(static_cast<size_t>(c.n_routed_experts * stride), {.node = -1, .huge_pages = false}, &off);
    EXPECT_OK(buf);
    a.layers.push_back(std::move(*buf));
    a.proto.add_layer_offsets(static_cast<uint64_t>(off));
  }
  EXPECT_OK(a.file->Seal());
  a.proto.set_fd(static_cast<uint32_t>(a.file->fd()));
  a.proto.set_bytes(static_cast<uint64_t>(a.file->size()));
  a.proto.set_num_experts(static_cast<uint32_t>(c.n_routed_experts));
  a.proto.set_hidden(static_cast<uint32_t>(c.hidden_size));
  a.proto.set_inter(static_cast<uint32_t>(c.moe_intermediate_size));
  a.proto.set_stride(static_cast<uint64_t>(stride));
  return a;
}

v1::RegisterRequest Request(const Arena& a) {
  v1::RegisterRequest r;
  r.set_worker_id("w");
  r.set_pid(static_cast<uint32_t>(getpid()));
  r.set_model_fingerprint("fp");
  r.set_max_sequences(2);
  r.set_max_step_tokens(16);
  r.set_expert_row_seconds(1e-4);
  *r.mutable_expert_arena() = a.proto;
  return r;
}

// numoe-gpu's options for these tests: GPU prefill on at `threshold`, no prefix cache.
GpuServerOptions PrefillOptions(int64_t threshold) {
  GpuServerOptions o;
  o.fingerprint = "fp";
  o.gpu_prefill = true;
  o.gpu_prefill_threshold = threshold;
  o.prefix_cache = false;
  return o;
}

TEST(GpuPrefillRegisterTest, ChecksTheArenaAndFallsBackWhereTheBackendCannot) {
  ASSERT_OK_AND_ASSIGN(test::TinyModel * tiny, test::TinyModel::Get());
  const ModelConfig& c = tiny->ckpt->config();
  GpuServer server(tiny->model.get(), c, PrefillOptions(1));
  const Arena arena = MakeArena(c);

  v1::RegisterRequest bad = Request(arena);
  bad.mutable_expert_arena()->set_inter(static_cast<uint32_t>(c.moe_intermediate_size * 2));
  auto refused = server.Register(bad);
  EXPECT_TRUE(absl::IsInvalidArgument(refused.status())) << refused.status();
  EXPECT_NE(refused.status().message().find("expert_arena.inter"), std::string::npos) << refused.status();
  bad = Request(arena);
  bad.mutable_expert_arena()->set_layer_offsets(1, 4096 * 3 + 1);
  refused = server.Register(bad);
  EXPECT_NE(refused.status().message().find("expert_arena.layer_offsets[1]"), std::string::npos) << refused.status();
  bad = Request(arena);
  bad.set_expert_row_seconds(-1);
  refused = server.Register(bad);
  EXPECT_NE(refused.status().message().find("expert_row_seconds"), std::string::npos) << refused.status();
  EXPECT_EQ(server.Stats().workers(), 0u);

  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse ok, server.Register(Request(arena)));
  EXPECT_TRUE(ok.gpu_prefill());
  EXPECT_EQ(server.Stats().workers(), 1u);
  // A worker whose arena cannot be opened (a descriptor this process lacks) still registers, without GPU prefill.
  v1::RegisterRequest closed = Request(arena);
  closed.mutable_expert_arena()->set_fd(1 << 20);
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse off, server.Register(closed));
  EXPECT_FALSE(off.gpu_prefill());
  server.Shutdown();
}

TEST(GpuPrefillRegisterTest, ThresholdZeroIgnoresTheArena) {
  ASSERT_OK_AND_ASSIGN(test::TinyModel * tiny, test::TinyModel::Get());
  const ModelConfig& c = tiny->ckpt->config();
  GpuServer server(tiny->model.get(), c, PrefillOptions(0));
  const Arena arena = MakeArena(c);
  v1::RegisterRequest bad = Request(arena);
  bad.mutable_expert_arena()->set_inter(7);  // not looked at
  ASSERT_OK_AND_ASSIGN(v1::RegisterResponse r, server.Register(bad));
  EXPECT_FALSE(r.gpu_prefill());
  server.Shutdown();
}

}  // namespace
}  // namespace numoe::gpu
