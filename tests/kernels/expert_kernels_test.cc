// Differential tests: every expert-kernel ISA present on this machine against a float64 reference computed
// from checkpoint-format MXFP4 (so the packing is tested too), with each ISA's documented error bound
// asserted per output element, plus a normwise check that the bound is not hiding a gross error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "tests/kernels/expert_test_util.h"
#include "worker/experts/expert_layer.h"
#include "worker/experts/isa.h"
#include "worker/experts/kernel_ops.h"
#include "worker/experts/moe_compute.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using test::ActError;
using test::OwnedExpert;
using test::RandomExperts;
using test::Reference;
using test::ReferenceMoe;
using test::Refs;

// Pack's StatusOr unwrapped inside a void test helper.
#define ASSERT_OK_AND_ASSIGN_LAYER(name, expr)            \
  auto name##_or = (expr);                                \
  ASSERT_OK(name##_or);      \
  auto name = std::move(name##_or).value()

struct IsaCase {
  const char* name;
  Isa isa;
  bool emulate_amx;
  ActivationPrecision precision;
  bool without_vbmi = false;  // the AVX-512 int8 kernel's plain decode even where the CPU has VBMI
};

void PrintTo(const IsaCase& c, std::ostream* os) { *os << c.name; }

constexpr auto kHigh = ActivationPrecision::kHigh;
constexpr auto kLow = ActivationPrecision::kLow;
const IsaCase kCases[] = {
    {"generic", Isa::kGeneric, false, kHigh},
    {"avx2", Isa::kAvx2, false, kHigh},
    {"avx2_int8", Isa::kAvx2, false, kLow},
    {"avx512", Isa::kAvx512, false, kHigh},
    {"avx512_int8", Isa::kAvx512, false, kLow},
    {"avx512_novbmi", Isa::kAvx512, false, kHigh, true},
    {"avx512_novbmi_int8", Isa::kAvx512, false, kLow, true},
    {"amx", Isa::kAmx, false, kHigh},
    {"amx_bf16x1", Isa::kAmx, false, kLow},
    {"amx_emulated", Isa::kAmx, true, kHigh},
    {"amx_emulated_bf16x1", Isa::kAmx, true, kLow},
};

bool CaseAvailable(const IsaCase& c) {
  if (!c.emulate_amx) return IsaAvailable(c.isa);
  const CpuFeatures& f = GetCpuFeatures();
  return IsaAvailable(Isa::kAvx512) && f.avx512bf16 && f.avx512vbmi;
}

// The layout is shared by every ISA; the emulated AMX case packs for AVX-512 (its fallback).
Isa PackIsa(const IsaCase& c) { return c.emulate_amx ? Isa::kAvx512 : c.isa; }

ActError ErrorModel(const IsaCase& c) {
  if (c.isa == Isa::kGeneric) return ActError::kNone;
  return c.precision == kHigh ? ActError::kInt8x2 : ActError::kInt8;
}

// Normwise relative error allowed on top of the elementwise bound (see CheckStep).
double NormTolerance(const IsaCase& c) {
  if (c.isa == Isa::kGeneric) return 1e-6;
  return c.precision == kHigh ? 1e-3 : 4e-2;
}

constexpr double kEps = 1e-5;      // fp32 rounding slack per GEMV, relative to sum |W| |a|
constexpr float kGuard = 1.2345e30f;
constexpr int64_t kGuardFloats = 64;

// A float buffer with guard regions on both sides.
struct Guarded {
  std::vector<float> storage;
  explicit Guarded(int64_t n, float fill) : storage(n + 2 * kGuardFloats, kGuard) {
    std::fill(storage.begin() + kGuardFloats, storage.end() - kGuardFloats, fill);
  }
  float* data() { return storage.data() + kGuardFloats; }
  bool guards_intact() const {
    for (int64_t i = 0; i < kGuardFloats; ++i) {
      if (storage[i] != kGuard || storage[storage.size() - 1 - i] != kGuard) return false;
    }
    return true;
  }
};

class ExpertKernelTest : public ::testing::TestWithParam<IsaCase> {
 protected:
  void SetUp() override {
    if (!CaseAvailable(GetParam())) GTEST_SKIP() << GetParam().name << " not available on this CPU/OS";
    pool_ = std::make_unique<ThreadPool>(2);
  }

  MoeComputeOptions Options() const {
    MoeComputeOptions o;
    o.emulate_amx = GetParam().emulate_amx;
    o.precision = GetParam().precision;
    o.avx512_without_vbmi = GetParam().without_vbmi;
    return o;
  }

  struct Step {
    int64_t hidden, inter, experts, rows, top_k;
    float limit = 10.0f;
    double zero_weight_fraction = 0.0;  // routing weights set to exactly 0
    double duplicate_fraction = 0.0;    // slots that repeat the row's previous expert
    bool zero_expert = false;           // expert 0 has all-zero nibbles and is routed to
  };

  // Runs one step on the ISA under test and checks every output against the bound.
  void CheckStep(const Step& s, uint32_t seed, const MoeComputeOptions* options = nullptr) {
    std::mt19937 rng(seed);
    std::vector<OwnedExpert> experts = RandomExperts(s.experts, s.hidden, s.inter, rng);
    if (s.zero_expert) {
      std::fill(experts[0].w1.packed.begin(), experts[0].w1.packed.end(), 0);
      std::fill(experts[0].w3.packed.begin(), experts[0].w3.packed.end(), 0x88);  // -0
      std::fill(experts[0].w2.packed.begin(), experts[0].w2.packed.end(), 0);
    }
    std::uniform_real_distribution<float> ux(-1.0f, 1.0f), uw(0.05f, 1.0f), u01(0.0f, 1.0f);
    std::uniform_int_distribution<int32_t> ue(0, static_cast<int32_t>(s.experts - 1));
    std::vector<float> x(s.rows * s.hidden), weights(s.rows * s.top_k);
    std::vector<int32_t> ids(s.rows * s.top_k);
    for (auto& v : x) v = ux(rng) * (u01(rng) < 0.05f ? 8.0f : 1.0f);  // some outliers
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t k = 0; k < s.top_k; ++k) {
        const int64_t i = r * s.top_k + k;
        ids[i] = (k > 0 && u01(rng) < s.duplicate_fraction) ? ids[i - 1] : ue(rng);
        if (s.zero_expert && r % 3 == 0 && k == 0) ids[i] = 0;
        weights[i] = u01(rng) < s.zero_weight_fraction ? 0.0f : uw(rng);
      }
    }
    ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(s.hidden, s.inter, Refs(experts), PackIsa(GetParam())));
    // The same step through the pool (threads sharing experts) and on the calling thread alone (how tiny
    // steps run): both must be bitwise identical, since each output column is summed in expert order.
    MoeComputeOptions pooled = options ? *options : Options();
    pooled.inline_max_bytes = 0;
    MoeComputeOptions alone = pooled;
    alone.inline_max_bytes = std::numeric_limits<int64_t>::max();
    MoeCompute moe(pool_.get(), GetParam().isa, pooled), moe_alone(pool_.get(), GetParam().isa, alone);
    Guarded out(s.rows * s.hidden, std::nanf("")), out_alone(s.rows * s.hidden, std::nanf(""));
    MoeBatch batch{s.rows, s.top_k, x.data(), ids.data(), weights.data(), out.data()};
    ASSERT_OK(moe.Run(*layer, s.limit, batch));
    EXPECT_TRUE(out.guards_intact()) << "write outside out[rows, hidden]";
    EXPECT_EQ(moe.pooled_runs(), 1);
    batch.out = out_alone.data();
    ASSERT_OK(moe_alone.Run(*layer, s.limit, batch));
    EXPECT_TRUE(out_alone.guards_intact()) << "write outside out[rows, hidden] (inline)";
    EXPECT_EQ(moe_alone.inline_runs(), 1);
    EXPECT_EQ(std::memcmp(out.data(), out_alone.data(), sizeof(float) * s.rows * s.hidden), 0)
        << GetParam().name << ": inline and pooled runs differ";

    const Reference ref = ReferenceMoe(experts, s.hidden, s.inter, s.limit, x, ids, weights, s.rows, s.top_k,
                                       ErrorModel(GetParam()), kEps);
    double err2 = 0, ref2 = 0;
    int64_t bad = 0;
    for (int64_t i = 0; i < s.rows * s.hidden; ++i) {
      const double got = out.data()[i], want = ref.out[i];
      err2 += (got - want) * (got - want);
      ref2 += want * want;
      if (!(std::abs(got - want) <= ref.bound[i])) {
        if (++bad <= 5) {
          ADD_FAILURE() << GetParam().name << ": out[" << i / s.hidden << "][" << i % s.hidden << "] = " << got
                        << ", reference " << want << ", bound " << ref.bound[i];
        }
      }
    }
    EXPECT_EQ(bad, 0) << "elements outside the bound";
    // Normwise: generic is the reference (~1e-7); two-level activations land near 1e-4 and one int8 level
    // near 1-2% (steps of max/127 per 32 columns, and this data has 8x outliers): the tolerances catch gross
    // errors that the worst-case elementwise bound, loose by design, might let through.
    const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
    EXPECT_LE(rel, NormTolerance(GetParam())) << GetParam().name;
    RecordProperty("relative_l2_error", std::to_string(rel));
    if (getenv("NUMOE_TEST_VERBOSE")) printf("%s rel %.3g\n", GetParam().name, rel);
  }

  std::unique_ptr<ThreadPool> pool_;
};

TEST_P(ExpertKernelTest, OneRowDecode) { CheckStep({256, 128, 8, 1, 6}, 1); }

// Every read-ahead mode (MoeComputeOptions::read_ahead; off, the default, runs in every other test), with
// the prefetch into L2 or L1, at 1 and 4 rows and with work units small enough that every thread claims
// several: within the bound, and the pooled run the same bits as the inline one.
TEST_P(ExpertKernelTest, ReadAheadModes) {
  for (int64_t mode = 1; mode <= 3; ++mode) {
    for (int64_t rows : {1, 4}) {
      SCOPED_TRACE(::testing::Message() << "read_ahead " << mode << ", rows " << rows);
      MoeComputeOptions o = Options();
      o.read_ahead = mode;
      o.prefetch_l1 = mode % 2;
      o.gate_up_chunk = 1;
      o.down_chunk = 1;
      CheckStep({256, 128, 8, rows, 6}, 31 + static_cast<uint32_t>(rows), &o);
    }
  }
}

TEST_P(ExpertKernelTest, ShapesNotMultiplesOfAnyBlock) {
  // hidden 200: partial 32-block, partial 128 super-block, partial 16-row down tile; inter 72 likewise.
  CheckStep({200, 72, 5, 3, 4}, 2);
  CheckStep({130, 34, 3, 7, 2}, 3);
}

TEST_P(ExpertKernelTest, HundredsOfRows) {
  // ~110 rows per expert: several activation groups, and the AMX path with partial 64-row blocks.
  CheckStep({384, 160, 16, 300, 6}, 4);
}

TEST_P(ExpertKernelTest, EveryGroupSize) {
  // 1..20 rows on a single expert covers every group size of every ISA (8 on AVX-512, 3 on AVX2).
  for (int64_t rows = 1; rows <= 20; ++rows) {
    SCOPED_TRACE(rows);
    CheckStep({128, 64, 1, rows, 1}, 100 + static_cast<uint32_t>(rows));
  }
}

TEST_P(ExpertKernelTest, DuplicateExpertsInARow) {
  Step s{256, 96, 4, 9, 6};
  s.duplicate_fraction = 0.5;
  CheckStep(s, 5);
}

TEST_P(ExpertKernelTest, ZeroWeightsAndZeroExpert) {
  Step s{192, 64, 6, 12, 4};
  s.zero_weight_fraction = 0.3;
  s.zero_expert = true;
  CheckStep(s, 6);
}

TEST_P(ExpertKernelTest, NoClampWhenLimitIsZero) {
  Step s{256, 128, 8, 5, 6};
  s.limit = 0.0f;
  CheckStep(s, 7);
}

TEST_P(ExpertKernelTest, AmxForEveryExpertSize) {
  if (GetParam().isa != Isa::kAmx) GTEST_SKIP() << "AMX-only dispatch knob";
  MoeComputeOptions o = Options();
  o.amx_min_rows = 1;  // even 1-row experts on tiles
  CheckStep({256, 96, 6, 11, 6}, 8, &o);
}

TEST_P(ExpertKernelTest, RejectsBadIdsBeforeComputing) {
  std::mt19937 rng(9);
  auto experts = RandomExperts(4, 64, 32, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(64, 32, Refs(experts), PackIsa(GetParam())));
  MoeCompute moe(pool_.get(), GetParam().isa, Options());
  std::vector<float> x(2 * 64, 1.0f), w(4, 0.5f);
  Guarded out(2 * 64, 7.0f);
  for (int32_t bad : {-1, 4, 1000}) {
    std::vector<int32_t> ids = {0, 1, 2, bad};
    Status st = moe.Run(*layer, 10.0f, MoeBatch{2, 2, x.data(), ids.data(), w.data(), out.data()});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(st.message()).find("expert_ids[1][1]"), std::string::npos) << st;
    for (int64_t i = 0; i < 2 * 64; ++i) ASSERT_EQ(out.data()[i], 7.0f) << "out touched on error";
  }
  std::vector<int32_t> ids = {0, 1, 2, 3};
  EXPECT_EQ(moe.Run(*layer, -1.0f, MoeBatch{2, 2, x.data(), ids.data(), w.data(), out.data()}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(moe.Run(*layer, 10.0f, MoeBatch{2, 2, nullptr, ids.data(), w.data(), out.data()}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_OK(moe.Run(*layer, 10.0f, MoeBatch{0, 2, nullptr, nullptr, nullptr, nullptr}));
}

TEST_P(ExpertKernelTest, ZeroTopKWritesZeros) {
  std::mt19937 rng(10);
  auto experts = RandomExperts(2, 64, 32, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(64, 32, Refs(experts), PackIsa(GetParam())));
  MoeCompute moe(pool_.get(), GetParam().isa, Options());
  std::vector<float> x(3 * 64, 1.0f);
  Guarded out(3 * 64, 7.0f);
  ASSERT_OK(moe.Run(*layer, 10.0f, MoeBatch{3, 0, x.data(), nullptr, nullptr, out.data()}));
  for (int64_t i = 0; i < 3 * 64; ++i) EXPECT_EQ(out.data()[i], 0.0f);
  EXPECT_TRUE(out.guards_intact());
}

// The kernel-level contract (one GEMV over packed tiles) with the single-stage bound, for every row count
// 1..19 and a shape with partial tiles and blocks.
TEST_P(ExpertKernelTest, TileKernelSingleGemvBound) {
  const IsaCase& c = GetParam();
  const experts::KernelOps* ops = nullptr;
  switch (c.isa) {
    case Isa::kGeneric: ops = &experts::GenericKernelOps(); break;
    case Isa::kAvx2: ops = &experts::Avx2KernelOps(c.precision); break;
    case Isa::kAvx512: ops = &MoeCompute(pool_.get(), c.isa, Options()).Int8Ops(); break;
    case Isa::kAmx:
      ops = c.emulate_amx ? &experts::AmxEmulatedKernelOps(c.precision) : &experts::AmxKernelOps(c.precision);
      break;
  }
  std::mt19937 rng(11);
  const int64_t hidden = 328, inter = 40;  // gate tiles: 3 (last partial), K = 328 -> 3 super-blocks
  auto experts = RandomExperts(1, hidden, inter, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(hidden, inter, Refs(experts), PackIsa(c)));
  const auto& shape = layer->shape();
  const int64_t kp = shape.gate_up().padded_cols();
  for (int64_t m = 1; m < 20; ++m) {
    SCOPED_TRACE(m);
    std::vector<float> x(m * hidden);
    std::uniform_real_distribution<float> ux(-2.0f, 2.0f);
    for (auto& v : x) v = ux(rng);
    std::vector<const float*> rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = x.data() + i * hidden;
    std::vector<uint8_t> acts(ops->act_bytes(m, kp) + 64), scratch(ops->scratch_bytes(kp) + 64);
    uint8_t* acts64 = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(acts.data()) + 63) & ~uintptr_t{63});
    uint8_t* scratch64 =
        reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
    ops->prepare_acts(rows.data(), m, hidden, kp, acts64);
    // All gate tiles: tiles 0, 2, 4 of the interleaved w13 (stride of two tiles).
    const int64_t tiles = shape.gate_up().tiles();
    const int64_t ldo = 16 * tiles + 5;
    Guarded y(m * ldo, std::nanf(""));
    experts::TileArgs args;
    args.tiles = layer->expert_data(0);
    args.num_tiles = tiles;
    args.tile_stride = 2 * shape.gate_up().tile_bytes();
    args.supers = kp / 128;
    args.acts = acts64;
    args.m = m;
    args.out = y.data();
    args.ldo = ldo;
    args.scratch = scratch64;
    ops->tiles(args);
    EXPECT_TRUE(y.guards_intact());
    std::vector<double> a(hidden), zero(hidden, 0.0), want, bound;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t col = 0; col < hidden; ++col) a[col] = x[i * hidden + col];
      test::GemvWithBound(experts[0].w1, a, zero, ErrorModel(c), kEps, &want, &bound);
      for (int64_t r = 0; r < inter; ++r) {
        const double got = y.data()[i * ldo + r];
        ASSERT_LE(std::abs(got - want[r]), bound[r]) << "row " << i << " output " << r << ": " << got << " vs "
                                                       << want[r];
      }
    }
  }
}

// The int8 kernels read up to four tiles at once (int8_tiles.h StreamsFor), on AVX2 take both 8-row halves of
// a tile in one pass (WidePasses) and, with VBMI, decode with byte permutes: none may change a bit of the result. Every tile count 1..9 (all remainders of the
// stream counts) and row count 1..13 (group sizes and their remainders), one call against tile by tile.
TEST_P(ExpertKernelTest, Int8StreamsAndDecodeSameBits) {
  const IsaCase& c = GetParam();
  if (c.isa != Isa::kAvx2 && c.isa != Isa::kAvx512) GTEST_SKIP() << "int8 kernels only";
  const experts::KernelOps& ops = c.isa == Isa::kAvx2 ? experts::Avx2KernelOps(c.precision)
                                                       : MoeCompute(pool_.get(), c.isa, Options()).Int8Ops();
  const experts::KernelOps& one =
      c.isa == Isa::kAvx2 ? experts::Avx2KernelOps(c.precision) : experts::Avx512KernelOps(c.precision);
  std::mt19937 rng(21);
  const int64_t hidden = 256, inter = 72;  // 5 gate tiles (the last partial), 10 in w13
  auto experts = RandomExperts(1, hidden, inter, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(hidden, inter, Refs(experts), PackIsa(c)));
  const auto& shape = layer->shape();
  const int64_t kp = shape.gate_up().padded_cols(), tile_bytes = shape.gate_up().tile_bytes();
  std::uniform_real_distribution<float> ux(-2.0f, 2.0f);
  for (int64_t m = 1; m <= 13; ++m) {
    std::vector<float> x(m * hidden);
    for (auto& v : x) v = ux(rng);
    std::vector<const float*> rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = x.data() + i * hidden;
    std::vector<uint8_t> acts(ops.act_bytes(m, kp) + 64);
    uint8_t* acts64 = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(acts.data()) + 63) & ~uintptr_t{63});
    ops.prepare_acts(rows.data(), m, hidden, kp, acts64);
    for (int64_t tiles = 1; tiles <= 9; ++tiles) {
      SCOPED_TRACE(::testing::Message() << "m " << m << ", tiles " << tiles);
      const int64_t ldo = 16 * tiles + 3;
      std::vector<float> all(m * ldo, std::nanf("")), each(m * ldo, std::nanf(""));
      experts::TileArgs args;
      args.tiles = layer->expert_data(0);
      args.num_tiles = tiles;
      args.tile_stride = tile_bytes;
      args.supers = kp / 128;
      args.acts = acts64;
      args.m = m;
      args.out = all.data();
      args.ldo = ldo;
      args.prefetch_bytes = 4096;
      ops.tiles(args);
      // Reading ahead (here: the same tiles once more) and skipping the prefetch (the tiles were read
      // ahead) or prefetching into L1 change no bits, and the range is read to its end.
      std::vector<float> ahead_out(m * ldo, std::nanf(""));
      const experts::ByteRange range{args.tiles, args.tiles + tiles * tile_bytes};
      experts::ReadAhead ra{nullptr, nullptr, &range, &range + 1, static_cast<int>(m % 3) + 1};
      experts::TileArgs ar = args;
      ar.out = ahead_out.data();
      ar.read_ahead = &ra;
      ar.tiles_read_ahead = m % 2 == 0;
      ar.prefetch_l1 = m % 2 == 1;
      ops.tiles(ar);
      EXPECT_TRUE(ra.next == ra.last && ra.p == range.end) << "read ahead up to " << (ra.p - range.begin) << " of "
                                                           << (range.end - range.begin) << " bytes";
      // One pass per 8-row half (AVX2 without wide passes) gives the same bits as both halves in one pass.
      std::vector<float> narrow(m * ldo, std::nanf(""));
      experts::TileArgs an = args;
      an.out = narrow.data();
      an.wide_passes = false;
      ops.tiles(an);
      for (int64_t t = 0; t < tiles; ++t) {
        experts::TileArgs a1 = args;
        a1.tiles = layer->expert_data(0) + t * tile_bytes;
        a1.num_tiles = 1;
        a1.out = each.data() + 16 * t;
        one.tiles(a1);
      }
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t col = 0; col < 16 * tiles; ++col) {
          const float a = all[i * ldo + col], e = each[i * ldo + col];
          ASSERT_EQ(std::memcmp(&a, &e, 4), 0) << "row " << i << " column " << col << ": " << a << " vs " << e;
          ASSERT_EQ(std::memcmp(&a, &ahead_out[i * ldo + col], 4), 0) << "read-ahead: row " << i << " column " << col;
          ASSERT_EQ(std::memcmp(&a, &narrow[i * ldo + col], 4), 0) << "one pass per half: row " << i << " column " << col;
        }
      }
    }
  }
}

// The AVX-512 prefill path (weight tiles decoded once per call, 4 rows x 2-3 tiles per microkernel) must
// give the streaming int8 kernel's result bit for bit, for row counts around its row block and the
// dispatch threshold (1, 15, 16, 17, 64, 511, 512, 513, 2048 and odd tails) and every tile count 1..7
// (all remainders of its tile run), on a shape with a partial last tile and K of 2 super-blocks.
TEST_P(ExpertKernelTest, Int8PrefillSameBits) {
  const IsaCase& c = GetParam();
  if (c.isa != Isa::kAvx512) GTEST_SKIP() << "AVX-512 int8 kernels only";
  MoeCompute moe(pool_.get(), c.isa, Options());
  const experts::KernelOps& stream = moe.Int8Ops();
  const experts::KernelOps& prefill = c.without_vbmi ? experts::Avx512PrefillKernelOps(c.precision)
                                                     : experts::Avx512VbmiPrefillKernelOps(c.precision);
  EXPECT_EQ(&moe.Int8OpsFor(4096), &prefill);
  EXPECT_EQ(&moe.Int8OpsFor(1), &stream);
  std::mt19937 rng(22);
  const int64_t hidden = 200, inter = 104;  // 7 gate tiles (the last partial); K 200 -> 2 super-blocks
  auto experts = RandomExperts(1, hidden, inter, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(hidden, inter, Refs(experts), PackIsa(c)));
  const auto& shape = layer->shape();
  const int64_t kp = shape.gate_up().padded_cols(), tile_bytes = shape.gate_up().tile_bytes();
  std::uniform_real_distribution<float> ux(-2.0f, 2.0f);
  const auto aligned = [](std::vector<uint8_t>& v) {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
  };
  for (int64_t m : {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 64, 511, 512, 513, 2048}) {
    std::vector<float> x(m * hidden);
    for (auto& v : x) v = ux(rng) * (ux(rng) > 1.9f ? 8.0f : 1.0f);
    std::vector<const float*> rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = x.data() + i * hidden;
    std::vector<uint8_t> acts_s(stream.act_bytes(m, kp) + 64), acts_p(prefill.act_bytes(m, kp) + 64);
    std::vector<uint8_t> scratch(prefill.scratch_bytes(kp) + 64);
    stream.prepare_acts(rows.data(), m, hidden, kp, aligned(acts_s));
    prefill.prepare_acts(rows.data(), m, hidden, kp, aligned(acts_p));
    for (int64_t tiles = 1; tiles <= 7; ++tiles) {
      SCOPED_TRACE(::testing::Message() << "m " << m << ", tiles " << tiles);
      const int64_t ldo = 16 * tiles + 3;
      Guarded want(m * ldo, std::nanf("")), got(m * ldo, std::nanf(""));
      experts::TileArgs args;
      args.tiles = layer->expert_data(0);
      args.num_tiles = tiles;
      args.tile_stride = tile_bytes;
      args.supers = kp / 128;
      args.acts = aligned(acts_s);
      args.m = m;
      args.out = want.data();
      args.ldo = ldo;
      args.prefetch_bytes = 4096;
      stream.tiles(args);
      args.acts = aligned(acts_p);
      args.out = got.data();
      args.scratch = aligned(scratch);
      prefill.tiles(args);
      ASSERT_TRUE(got.guards_intact()) << "write outside out[m, ldo]";
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t col = 0; col < ldo; ++col) {
          const float a = got.data()[i * ldo + col], e = want.data()[i * ldo + col];
          if (col >= 16 * tiles) {
            ASSERT_TRUE(std::isnan(a)) << "row " << i << " column " << col << " written past the tiles";
            continue;
          }
          ASSERT_EQ(std::memcmp(&a, &e, 4), 0) << "row " << i << " column " << col << ": " << a << " vs " << e;
        }
      }
    }
  }
}

// The kernel MoeCompute picks for prefill-sized experts (the AVX-512 prefill path from 8 rows, AMX from
// amx_min_rows; the others' only kernel) at row counts around its row blocks and panels (8, 17, 33, 48, 512,
// 700), over all of w13 (10 tiles: two and a half AMX panels, every int8 tile-run remainder) of a shape with
// partial tiles and blocks (K 328 -> 3 super-blocks), against the reference with the single-stage bound.
TEST_P(ExpertKernelTest, TileKernelPrefillRowsBound) {
  const IsaCase& c = GetParam();
  std::mt19937 rng(31);
  const int64_t hidden = 328, inter = 72;  // 5 gate and 5 up tiles, the last of each partial
  auto experts = RandomExperts(1, hidden, inter, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(hidden, inter, Refs(experts), PackIsa(c)));
  const auto& shape = layer->shape();
  const int64_t kp = shape.gate_up().padded_cols(), tiles = 2 * shape.gate_up().tiles();
  MoeCompute moe(pool_.get(), c.isa, Options());
  std::uniform_real_distribution<float> ux(-2.0f, 2.0f);
  const auto aligned = [](std::vector<uint8_t>& v) {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
  };
  for (int64_t m : {8, 17, 33, 48, 512, 700}) {
    const experts::KernelOps& ops = moe.OpsFor(m, layer->bf16_exact());
    SCOPED_TRACE(::testing::Message() << "m " << m << ", kernel " << ops.name);
    std::vector<float> x(m * hidden);
    for (auto& v : x) v = ux(rng) * (ux(rng) > 1.9f ? 8.0f : 1.0f);
    std::vector<const float*> rows(m);
    for (int64_t i = 0; i < m; ++i) rows[i] = x.data() + i * hidden;
    std::vector<uint8_t> acts(ops.act_bytes(m, kp) + 64), scratch(ops.scratch_bytes(kp) + 64);
    ops.prepare_acts(rows.data(), m, hidden, kp, aligned(acts));
    const int64_t ldo = 16 * tiles + 5;
    Guarded y(m * ldo, std::nanf(""));
    experts::TileArgs args;
    args.tiles = layer->expert_data(0);
    args.num_tiles = tiles;
    args.tile_stride = shape.gate_up().tile_bytes();
    args.supers = kp / 128;
    args.acts = aligned(acts);
    args.m = m;
    args.out = y.data();
    args.ldo = ldo;
    args.scratch = aligned(scratch);
    args.prefetch_bytes = 4096;
    ops.tiles(args);
    ASSERT_TRUE(y.guards_intact()) << "write outside out[m, ldo]";
    std::vector<double> a(hidden), zero(hidden, 0.0), gate, gate_bound, up, up_bound;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t col = 0; col < hidden; ++col) a[col] = x[i * hidden + col];
      test::GemvWithBound(experts[0].w1, a, zero, ErrorModel(c), kEps, &gate, &gate_bound);
      test::GemvWithBound(experts[0].w3, a, zero, ErrorModel(c), kEps, &up, &up_bound);
      for (int64_t r = 0; r < inter; ++r) {
        const int64_t col = 32 * (r / 16) + r % 16;  // gate tile t is w13 tile 2t, up tile t is 2t + 1
        const double g = y.data()[i * ldo + col], u = y.data()[i * ldo + col + 16];
        ASSERT_LE(std::abs(g - gate[r]), gate_bound[r]) << "row " << i << " gate " << r << ": " << g << " vs " << gate[r];
        ASSERT_LE(std::abs(u - up[r]), up_bound[r]) << "row " << i << " up " << r << ": " << u << " vs " << up[r];
      }
    }
  }
}

// The AMX kernel decodes a panel of weight tiles once per call and runs all of the call's row groups
// against it: a row's result must not depend on the call's other rows. 700 rows in one call against the
// same rows in calls of 16 (and 12 for the tail), bit for bit, over 10 tiles (panels of 4, 4 and 2).
TEST_P(ExpertKernelTest, AmxSameBitsForAnyRowCount) {
  const IsaCase& c = GetParam();
  if (c.isa != Isa::kAmx) GTEST_SKIP() << "AMX kernels only";
  const experts::KernelOps& ops =
      c.emulate_amx ? experts::AmxEmulatedKernelOps(c.precision) : experts::AmxKernelOps(c.precision);
  std::mt19937 rng(32);
  const int64_t hidden = 200, inter = 72, m = 700;  // K 200 -> 2 super-blocks
  auto experts = RandomExperts(1, hidden, inter, rng);
  ASSERT_OK_AND_ASSIGN_LAYER(layer, ExpertLayer::Pack(hidden, inter, Refs(experts), PackIsa(c)));
  const auto& shape = layer->shape();
  const int64_t kp = shape.gate_up().padded_cols(), tiles = 2 * shape.gate_up().tiles(), ldo = 16 * tiles + 3;
  std::uniform_real_distribution<float> ux(-2.0f, 2.0f);
  std::vector<float> x(m * hidden);
  for (auto& v : x) v = ux(rng);
  std::vector<const float*> rows(m);
  for (int64_t i = 0; i < m; ++i) rows[i] = x.data() + i * hidden;
  const auto aligned = [](std::vector<uint8_t>& v) {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
  };
  std::vector<uint8_t> scratch(ops.scratch_bytes(kp) + 64);
  std::vector<float> all(m * ldo, std::nanf("")), sliced(m * ldo, std::nanf(""));
  const auto run = [&](int64_t r0, int64_t n, float* out) {
    std::vector<uint8_t> acts(ops.act_bytes(n, kp) + 64);
    ops.prepare_acts(rows.data() + r0, n, hidden, kp, aligned(acts));
    experts::TileArgs args;
    args.tiles = layer->expert_data(0);
    args.num_tiles = tiles;
    args.tile_stride = shape.gate_up().tile_bytes();
    args.supers = kp / 128;
    args.acts = aligned(acts);
    args.m = n;
    args.out = out + r0 * ldo;
    args.ldo = ldo;
    args.scratch = aligned(scratch);
    ops.tiles(args);
  };
  run(0, m, all.data());
  for (int64_t r0 = 0; r0 < m; r0 += 16) run(r0, std::min<int64_t>(16, m - r0), sliced.data());
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t col = 0; col < 16 * tiles; ++col) {
      const float a = all[i * ldo + col], e = sliced[i * ldo + col];
      ASSERT_EQ(std::memcmp(&a, &e, 4), 0) << "row " << i << " column " << col << ": " << a << " vs " << e;
    }
  }
}

// Through MoeCompute: experts of hundreds of rows (the prefill path) and of a few (the streaming kernel)
// in one step, against the reference with the bound.
TEST_P(ExpertKernelTest, PrefillSizedExperts) { CheckStep({256, 80, 4, 600, 2}, 23); }

INSTANTIATE_TEST_SUITE_P(Isas, ExpertKernelTest, ::testing::ValuesIn(kCases),
                         [](const ::testing::TestParamInfo<IsaCase>& info) { return info.param.name; });

// ---- packing errors --------------------------------------------------------------------------------------

TEST(ExpertLayerPack, ErrorsNameExpertAndMatrix) {
  std::mt19937 rng(12);
  auto experts = RandomExperts(3, 64, 32, rng);
  auto refs = Refs(experts);
  refs[2].w3.rows = 31;
  auto st = ExpertLayer::Pack(64, 32, refs, Isa::kGeneric).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("expert 2 w3"), std::string::npos) << st;

  refs = Refs(experts);
  experts[1].w2.scales[5] = 0xFF;
  st = ExpertLayer::Pack(64, 32, refs, Isa::kGeneric).status();
  EXPECT_NE(std::string(st.message()).find("expert 1 w2"), std::string::npos) << st;
  EXPECT_NE(std::string(st.message()).find("NaN"), std::string::npos) << st;
  experts[1].w2.scales[5] = 127;

  refs = Refs(experts);
  refs[0].w1.packed = nullptr;
  EXPECT_EQ(ExpertLayer::Pack(64, 32, refs, Isa::kGeneric).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertLayer::Pack(63, 32, Refs(experts), Isa::kGeneric).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExpertLayer::Pack(64, 32, {}, Isa::kGeneric).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertLayerPack, GeometryAndBf16Range) {
  std::mt19937 rng(13);
  auto experts = RandomExperts(3, 4096 / 16, 2048 / 16, rng);
  auto layer = ExpertLayer::Pack(256, 128, Refs(experts), Isa::kGeneric);
  ASSERT_OK(layer);
  EXPECT_EQ((*layer)->num_experts(), 3);
  // Aligned shapes stream exactly the checkpoint's bytes: 3 matrices x (N K / 2 + N K / 32).
  EXPECT_EQ((*layer)->expert_stream_bytes(), 3 * (256 * 128 / 2 + 256 * 128 / 32));
  EXPECT_GE((*layer)->bytes(), static_cast<size_t>(3 * (*layer)->expert_stream_bytes()));
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*layer)->expert_data(0)) % 4096, 0u);
  EXPECT_TRUE((*layer)->bf16_exact());
  experts[2].w1.scales[0] = 1;
  layer = ExpertLayer::Pack(256, 128, Refs(experts), Isa::kGeneric);
  ASSERT_OK(layer);
  EXPECT_FALSE((*layer)->bf16_exact());
}

// The V4-Flash expert is 13.37 MB in the checkpoint; the packed stream must be the same size.
TEST(ExpertLayerPack, V4FlashExpertBytes) {
  experts::PackedExpertShape shape{4096, 2048};
  EXPECT_EQ(shape.data_bytes(), 3 * (2048LL * 4096 / 2 + 2048LL * 4096 / 32));
  EXPECT_EQ(shape.data_bytes(), 13369344);
}

}  // namespace
}  // namespace numoe
