// GPU prefill's shared expert arena on the CPU (no GPU needed): the worker's SharedArena (a sealed memfd of
// node-bound slices), numoe-gpu's checks of the arena a worker announces (every bad field refused by name), the
// mapping of a real arena through /proc/<pid>/fd, and the threshold calibration.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "common/numa.h"
#include "common/packed_layout.h"
#include "gpu_service/expert_arena.h"
#include "tests/support/status_matchers.h"

namespace numoe::gpu {
namespace {

ModelConfig SmallModel() {
  ModelConfig c;
  c.num_hidden_layers = 3;
  c.n_routed_experts = 4;
  c.hidden_size = 128;
  c.moe_intermediate_size = 64;
  return c;
}

int64_t Stride(const ModelConfig& c) { return experts::PackedExpertShape{c.hidden_size, c.moe_intermediate_size}.stride(); }

// A spec of three layers back to back at 2 MB steps (what SharedArena::Allocate hands out).
ExpertArenaSpec GoodSpec(const ModelConfig& c) {
  ExpertArenaSpec s;
  s.pid = static_cast<uint32_t>(getpid());
  s.fd = 3;
  s.num_experts = c.n_routed_experts;
  s.hidden = c.hidden_size;
  s.inter = c.moe_intermediate_size;
  s.stride = Stride(c);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) s.layer_offsets.push_back(l * (int64_t{2} << 20));
  s.bytes = c.num_hidden_layers * (int64_t{2} << 20);
  return s;
}

void ExpectRefused(const ExpertArenaSpec& s, const std::string& field) {
  const Status st = ValidateExpertArena(s, SmallModel());
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_NE(st.message().find("expert_arena." + field), std::string::npos) << st;
}

TEST(ExpertArenaTest, ValidatesEveryField) {
  const ModelConfig c = SmallModel();
  EXPECT_OK(ValidateExpertArena(GoodSpec(c), c));
  ExpertArenaSpec s = GoodSpec(c);
  s.num_experts = 5;
  ExpectRefused(s, "num_experts");
  s = GoodSpec(c);
  s.hidden = 256;
  ExpectRefused(s, "hidden");
  s = GoodSpec(c);
  s.inter = 32;
  ExpectRefused(s, "inter");
  s = GoodSpec(c);
  s.stride -= 4096;
  ExpectRefused(s, "stride");
  s = GoodSpec(c);
  s.layer_offsets.pop_back();
  ExpectRefused(s, "layer_offsets");
  s = GoodSpec(c);
  s.layer_offsets[1] += 64;  // not 4 KiB-aligned
  ExpectRefused(s, "layer_offsets[1]");
  s = GoodSpec(c);
  s.layer_offsets[2] = s.bytes - 4096;  // the layer runs past the file
  ExpectRefused(s, "layer_offsets[2]");
  s = GoodSpec(c);
  s.layer_offsets[0] = -4096;
  ExpectRefused(s, "layer_offsets[0]");
  s = GoodSpec(c);
  s.bytes = 0;
  ExpectRefused(s, "bytes");
  s = GoodSpec(c);
  s.fd = -1;
  ExpectRefused(s, "fd");
}

TEST(ExpertArenaTest, CalibratedThreshold) {
  // V4-Flash's layer (3.42 GB) over 25 GB/s is 137 ms; at 100 us of CPU experts per row that is 1368 rows.
  EXPECT_EQ(CalibratedPrefillRows(3'420'000'000, 25.0, 1e-4), 1368);
  EXPECT_EQ(CalibratedPrefillRows(1000, 1000.0, 1.0), 1);  // pays from the first row
  EXPECT_EQ(CalibratedPrefillRows(3'420'000'000, 0.0, 1e-4), 0);  // a speed unknown: never
  EXPECT_EQ(CalibratedPrefillRows(3'420'000'000, 25.0, 0.0), 0);
}

TEST(SharedArenaTest, SlicesShareOneSealedFile) {
  ASSERT_OK_AND_ASSIGN(auto arena, SharedArena::Create("numoe-test-arena", 6 << 20, /*huge_pages=*/false));
  int64_t off0 = -1, off1 = -1;
  ASSERT_OK_AND_ASSIGN(NodeBuffer a, arena->Allocate(1000, {.node = -1, .huge_pages = false}, &off0));
  ASSERT_OK_AND_ASSIGN(NodeBuffer b, arena->Allocate((2 << 20) + 1, {.node = -1, .huge_pages = false}, &off1));
  EXPECT_EQ(off0, 0);
  EXPECT_EQ(off1, 2 << 20);          // 1000 bytes take one 2 MB slice
  EXPECT_EQ(arena->size(), 6 << 20);  // the second takes two
  std::memset(b.data(), 0x5a, b.size());
  // The file holds what the slices wrote.
  void* view = mmap(nullptr, static_cast<size_t>(arena->size()), PROT_READ, MAP_SHARED, arena->fd(), 0);
  ASSERT_NE(view, MAP_FAILED);
  EXPECT_EQ(static_cast<const uint8_t*>(view)[off1 + 12345], 0x5a);
  munmap(view, static_cast<size_t>(arena->size()));
  ASSERT_OK(arena->Seal());
  int64_t off2 = -1;
  auto more = arena->Allocate(1, {.node = -1, .huge_pages = false}, &off2);
  EXPECT_TRUE(absl::IsFailedPrecondition(more.status())) << more.status();
  EXPECT_NE(ftruncate(arena->fd(), 0), 0);  // sealed against shrinking
}

// A real arena of this process, mapped the way numoe-gpu maps a worker's (through /proc/<pid>/fd/<fd>).
TEST(ExpertArenaTest, MapsASealedArena) {
  const ModelConfig c = SmallModel();
  ASSERT_OK_AND_ASSIGN(auto arena, SharedArena::Create("numoe-test-arena", 6 << 20, /*huge_pages=*/false));
  std::vector<NodeBuffer> layers;
  ExpertArenaSpec spec = GoodSpec(c);
  spec.fd = arena->fd();
  const size_t layer_bytes = static_cast<size_t>(c.n_routed_experts * Stride(c));
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    int64_t off = -1;
    ASSERT_OK_AND_ASSIGN(NodeBuffer buf, arena->Allocate(layer_bytes, {.node = -1, .huge_pages = false}, &off));
    std::memset(buf.data(), static_cast<int>(0x10 + l), layer_bytes);
    spec.layer_offsets[static_cast<size_t>(l)] = off;
    layers.push_back(std::move(buf));
  }
  spec.bytes = arena->size();

  // Not sealed yet: it could shrink under the mapping.
  auto unsealed = MappedExpertArena::Map(spec, c);
  EXPECT_TRUE(absl::IsFailedPrecondition(unsealed.status())) << unsealed.status();
  EXPECT_NE(unsealed.status().message().find("sealed"), std::string::npos) << unsealed.status();
  ASSERT_OK(arena->Seal());

  ASSERT_OK_AND_ASSIGN(auto mapped, MappedExpertArena::Map(spec, c));
  HostExperts* he = mapped->host_experts();
  ASSERT_EQ(he->layers.size(), 3u);
  ASSERT_EQ(he->regions.size(), 1u);
  EXPECT_EQ(he->regions[0].bytes, spec.bytes);
  EXPECT_EQ(he->layer_bytes(), static_cast<int64_t>(layer_bytes));
  EXPECT_EQ(he->min_rows, 0);
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(he->layers[static_cast<size_t>(l)][0], 0x10 + l);
    EXPECT_EQ(he->layers[static_cast<size_t>(l)][layer_bytes - 1], 0x10 + l);
  }
  EXPECT_FALSE(mapped->writable());
  ASSERT_OK_AND_ASSIGN(auto rw, mapped->Reopen(/*writable=*/true));
  EXPECT_TRUE(rw->writable());
  EXPECT_EQ(rw->host_experts()->layers[1][7], 0x11);

  // The size must be the announced one.
  ExpertArenaSpec wrong = spec;
  wrong.bytes += 2 << 20;
  wrong.layer_offsets = spec.layer_offsets;
  auto sized = MappedExpertArena::Map(wrong, c);
  EXPECT_TRUE(absl::IsFailedPrecondition(sized.status())) << sized.status();
  EXPECT_NE(sized.status().message().find("expert_arena.bytes"), std::string::npos) << sized.status();
  // A descriptor this process does not have cannot be opened.
  ExpertArenaSpec gone = spec;
  gone.fd = 1 << 20;
  auto missing = MappedExpertArena::Map(gone, c);
  EXPECT_TRUE(absl::IsFailedPrecondition(missing.status())) << missing.status();
  EXPECT_NE(missing.status().message().find("cannot open"), std::string::npos) << missing.status();
}

}  // namespace
}  // namespace numoe::gpu
