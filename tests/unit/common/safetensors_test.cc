// safetensors reader/writer: round trips and every corrupt-file case, asserting what the error says.
#include "common/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "tests/support/files.h"
#include "tests/support/fixtures.h"
#include "tests/support/status_matchers.h"

namespace numoe {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using test::SafetensorsBytes;
using test::TempDir;
using test::WriteFile;

const std::string kData = NUMOE_TEST_DATA;

std::string Msg(const Status& s) { return std::string(s.message()); }

// Opens `bytes` written as NAME in a scratch dir; returns the error (or OK).
Status OpenBytes(const TempDir& dir, const std::string& name, const std::string& bytes) {
  WriteFile(dir / name, bytes);
  return SafetensorsFile::Open(dir / name).status();
}

TEST(Safetensors, WriteThenReadEveryDType) {
  TempDir dir;
  const float f32[2] = {1.5f, -2.0f};
  const uint16_t bf16[3] = {0x3F80, 0x4000, 0xC040};
  const uint16_t f16[1] = {0x3C00};
  const uint8_t bytes[4] = {0x38, 0x7E, 0x01, 0xFF};
  const int32_t i32[2] = {7, -7};
  const int64_t i64[2] = {int64_t{1} << 40, -1};
  std::vector<TensorToWrite> ts = {
      {"a.f32", DType::kF32, {2}, f32},         {"b.bf16", DType::kBF16, {1, 3}, bf16},
      {"c.f16", DType::kF16, {1}, f16},         {"d.fp8", DType::kF8_E4M3, {2, 2}, bytes},
      {"e.e8m0", DType::kF8_E8M0, {4}, bytes},  {"f.i8", DType::kI8, {4}, bytes},
      {"g.u8", DType::kU8, {2, 2}, bytes},      {"h.i32", DType::kI32, {2}, i32},
      {"i.i64", DType::kI64, {2, 1}, i64},      {"j.empty", DType::kF32, {0, 4}, nullptr},
  };
  const std::string path = dir / "x.safetensors";
  ASSERT_OK(WriteSafetensors(path, ts, {{"format", "pt"}, {"note", "hi"}}));

  // Layout: 8-byte LE length, header padded with spaces to a multiple of 8.
  const std::string raw = test::ReadFile(path);
  uint64_t n = 0;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(raw[8], '{');
  EXPECT_EQ(raw.size(), 8 + n + 8 + 6 + 2 + 4 + 4 + 4 + 4 + 8 + 16);

  auto f = SafetensorsFile::Open(path);
  ASSERT_OK(f);
  EXPECT_EQ((*f)->tensors().size(), ts.size());
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  EXPECT_EQ((*f)->metadata().at("note"), "hi");
  for (const auto& w : ts) {
    const TensorView* t = (*f)->Find(w.name);
    ASSERT_NE(t, nullptr) << w.name;
    EXPECT_EQ(t->dtype, w.dtype) << w.name;
    EXPECT_EQ(t->shape, w.shape) << w.name;
    EXPECT_EQ(t->nbytes, static_cast<size_t>(t->numel()) * DTypeSize(w.dtype));
    if (t->nbytes) {
      EXPECT_EQ(std::memcmp(t->data, w.data, t->nbytes), 0) << w.name;
    }
    EXPECT_EQ(*t->file, path);
  }
  EXPECT_EQ((*f)->Find("b.bf16")->ShapeString(), "[1, 3]");
  EXPECT_EQ((*f)->Find("nope"), nullptr);

  // The same file opened as a store (path to the file).
  auto store = TensorStore::Open(path);
  ASSERT_OK(store);
  EXPECT_EQ((*store)->num_tensors(), ts.size());
  auto missing = (*store)->Get("zzz");
  ASSERT_FALSE(missing.ok());
  EXPECT_THAT(Msg(missing.status()), HasSubstr("zzz"));
}

TEST(Safetensors, DTypeNames) {
  for (auto [t, name, size] : std::vector<std::tuple<DType, std::string, size_t>>{
           {DType::kF32, "F32", 4}, {DType::kBF16, "BF16", 2}, {DType::kF16, "F16", 2},
           {DType::kF8_E4M3, "F8_E4M3", 1}, {DType::kF8_E8M0, "F8_E8M0", 1}, {DType::kI8, "I8", 1},
           {DType::kU8, "U8", 1}, {DType::kI32, "I32", 4}, {DType::kI64, "I64", 8}}) {
    EXPECT_EQ(DTypeName(t), name);
    EXPECT_EQ(DTypeSize(t), size);
    auto parsed = ParseDType(name);
    ASSERT_OK(parsed);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_THAT(Msg(ParseDType("F64").status()), HasSubstr("F64"));
}

TEST(SafetensorsCorrupt, TooSmall) {
  TempDir d;
  Status s = OpenBytes(d, "tiny.safetensors", "abc");
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("tiny.safetensors"), HasSubstr("too small")));
}

TEST(SafetensorsCorrupt, HeaderBomb2Pow63) {
  TempDir d;
  Status s = OpenBytes(d, "bomb.safetensors", SafetensorsBytes("{}", "", uint64_t{1} << 63));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("bomb.safetensors"), HasSubstr("9223372036854775808"), HasSubstr("absurd")));
}

TEST(SafetensorsCorrupt, HeaderLongerThanFile) {
  TempDir d;
  Status s = OpenBytes(d, "short.safetensors", SafetensorsBytes("{}", "", 4096));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("short.safetensors"), HasSubstr("header length 4096"),
                            HasSubstr("past the end")));
  // A 100 MB header claimed by a small file.
  s = OpenBytes(d, "claim.safetensors", SafetensorsBytes(R"({"__metadata__":{}})", "", 100'000'000));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("claim.safetensors"), HasSubstr("100000000"), HasSubstr("past the end")));
}

TEST(SafetensorsCorrupt, BadJson) {
  TempDir d;
  EXPECT_THAT(Msg(OpenBytes(d, "j.safetensors", SafetensorsBytes(R"({"a": {"dtype": )", ""))),
              AllOf(HasSubstr("j.safetensors"), HasSubstr("not valid JSON")));
  EXPECT_THAT(Msg(OpenBytes(d, "arr.safetensors", SafetensorsBytes("[1, 2]   ", ""))),
              AllOf(HasSubstr("arr.safetensors"), HasSubstr("not a JSON object")));
  EXPECT_THAT(Msg(OpenBytes(d, "m.safetensors", SafetensorsBytes(R"({"__metadata__": {"k": 3}})", ""))),
              AllOf(HasSubstr("m.safetensors"), HasSubstr("__metadata__"), HasSubstr("'k'")));
  EXPECT_THAT(Msg(OpenBytes(d, "e.safetensors", SafetensorsBytes(R"({"w": 5})", ""))),
              AllOf(HasSubstr("e.safetensors"), HasSubstr("'w'"), HasSubstr("not an object")));
}

TEST(SafetensorsCorrupt, UnknownDType) {
  TempDir d;
  Status s = OpenBytes(d, "dt.safetensors",
                       SafetensorsBytes(R"({"layers.0.w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
                                        std::string(8, '\0')));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("dt.safetensors"), HasSubstr("layers.0.w"), HasSubstr("unsupported dtype 'F64'")));
}

TEST(SafetensorsCorrupt, BadShapes) {
  TempDir d;
  Status s = OpenBytes(d, "neg.safetensors",
                       SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [-1, 2], "data_offsets": [0, 8]}})",
                                        std::string(8, '\0')));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("neg.safetensors"), HasSubstr("'t'"), HasSubstr("bad shape")));
  s = OpenBytes(d, "str.safetensors",
                SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}})", ""));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("str.safetensors"), HasSubstr("bad shape")));
  // 2^31 * 2^31 * 2^31 * 4 bytes overflows 64 bits: must be caught, not wrapped into a small size.
  s = OpenBytes(d, "ovf.safetensors",
                SafetensorsBytes(R"({"big": {"dtype": "F32", "shape": [2147483648, 2147483648, 2147483648],)"
                                 R"( "data_offsets": [0, 0]}})",
                                 ""));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("ovf.safetensors"), HasSubstr("'big'"), HasSubstr("overflows")));
  // 2^32 x 2^30 x 4 = 2^64 wraps to 0 in unsigned math; must not match data_offsets [0, 0].
  s = OpenBytes(d, "wrap.safetensors",
                SafetensorsBytes(R"({"wrap": {"dtype": "F32", "shape": [4294967296, 1073741824],)"
                                 R"( "data_offsets": [0, 0]}})",
                                 ""));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("wrap.safetensors"), HasSubstr("'wrap'"), HasSubstr("overflows")));
  s = OpenBytes(d, "huge.safetensors",
                SafetensorsBytes(R"({"h": {"dtype": "F32", "shape": [99999999999999999999], "data_offsets": [0, 0]}})",
                                 ""));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("huge.safetensors"), HasSubstr("'h'")));
}

TEST(SafetensorsCorrupt, Offsets) {
  TempDir d;
  const std::string data(16, '\x01');
  Status s = OpenBytes(d, "past.safetensors",
                       SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]}})", data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("past.safetensors"), HasSubstr("'t'"), HasSubstr("past the data section")));
  s = OpenBytes(d, "rev.safetensors",
                SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("rev.safetensors"), HasSubstr("'t'"), HasSubstr("reversed")));
  s = OpenBytes(d, "span.safetensors",
                SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("span.safetensors"), HasSubstr("'t'"), HasSubstr("12 bytes"),
                            HasSubstr("span 8 bytes")));
  s = OpenBytes(d, "over.safetensors",
                SafetensorsBytes(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
                                 R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
                                 data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("over.safetensors"), HasSubstr("'b'"), HasSubstr("overlaps"), HasSubstr("'a'")));
  s = OpenBytes(d, "neg.safetensors",
                SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}})", data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("neg.safetensors"), HasSubstr("bad data_offsets")));
  s = OpenBytes(d, "three.safetensors",
                SafetensorsBytes(R"({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 9]}})", data));
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("three.safetensors"), HasSubstr("data_offsets")));
}

// A real shard cut short: the last tensors' data_offsets now run past the end.
TEST(SafetensorsCorrupt, TruncatedFixtureShard) {
  TempDir d;
  test::CopyFiles(kData + "/tiny-v4", d.str());
  const std::string shard = d / "model-00002-of-00002.safetensors";
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 1000);
  auto f = SafetensorsFile::Open(shard);
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(Msg(f.status()), AllOf(HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("tensor '"),
                                     HasSubstr("past the data section")));
  auto store = TensorStore::Open(d.str());
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(Msg(store.status()), HasSubstr("model-00002-of-00002.safetensors"));
  // Cut inside the header.
  std::filesystem::resize_file(shard, 100);
  EXPECT_THAT(Msg(SafetensorsFile::Open(shard).status()),
              AllOf(HasSubstr("model-00002-of-00002.safetensors"), HasSubstr("past the end")));
}

TEST(SafetensorsCorrupt, FixtureHeaderBomb) {
  TempDir d;
  test::CopyFiles(kData + "/tiny-v4", d.str());
  const std::string shard = d / "model-00001-of-00002.safetensors";
  std::string raw = test::ReadFile(shard);
  const uint64_t bomb = uint64_t{1} << 63;
  std::memcpy(raw.data(), &bomb, 8);
  WriteFile(shard, raw);
  auto store = TensorStore::Open(d.str());
  ASSERT_FALSE(store.ok());
  EXPECT_THAT(Msg(store.status()), AllOf(HasSubstr("model-00001-of-00002.safetensors"), HasSubstr("absurd")));
}

// Random byte flips and truncations of a valid file: every outcome is an error or a file whose views all
// lie inside it (ASan in the sanitizer tree checks the rest).
TEST(SafetensorsCorrupt, RandomDamageNeverCrashes) {
  TempDir d;
  const float f[6] = {1, 2, 3, 4, 5, 6};
  const uint8_t b[5] = {1, 2, 3, 4, 5};
  ASSERT_TRUE(WriteSafetensors(d / "ok.safetensors",
                               {{"a.weight", DType::kF32, {2, 3}, f}, {"a.scale", DType::kF8_E8M0, {5}, b},
                                {"c", DType::kBF16, {3}, f}},
                               {{"format", "pt"}})
                  .ok());
  const std::string good = test::ReadFile(d / "ok.safetensors");
  uint64_t state = 12345;
  auto next = [&]() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return state >> 33;
  };
  int errors = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::string bad = good;
    if (iter % 5 == 4) {
      bad.resize(next() % bad.size());
    } else {
      const int flips = 1 + static_cast<int>(next() % 3);
      for (int k = 0; k < flips; ++k) {
        // Mostly inside the length field and header, where the parser looks.
        const size_t pos = next() % std::min<size_t>(bad.size(), 8 + 200);
        bad[pos] = static_cast<char>(next() & 0xFF);
      }
    }
    const std::string path = d / "bad.safetensors";
    WriteFile(path, bad);
    auto file = SafetensorsFile::Open(path);
    if (!file.ok()) {
      ++errors;
      EXPECT_THAT(Msg(file.status()), HasSubstr("bad.safetensors"));
      continue;
    }
    for (const TensorView& t : (*file)->tensors()) {
      ASSERT_EQ(t.nbytes, static_cast<size_t>(t.numel()) * DTypeSize(t.dtype));
      if (t.nbytes == 0) continue;
      // The view must lie inside the mapping; touch its first and last byte.
      volatile uint8_t first = t.data[0], last = t.data[t.nbytes - 1];
      (void)first;
      (void)last;
    }
  }
  EXPECT_GT(errors, 100);
}

// ---- sharded stores --------------------------------------------------------

void WriteShard(const std::string& path, const std::vector<std::string>& names) {
  static const float v[2] = {1, 2};
  std::vector<TensorToWrite> ts;
  for (const auto& n : names) ts.push_back({n, DType::kF32, {2}, v});
  ASSERT_OK(WriteSafetensors(path, ts));
}

TEST(TensorStore, ShardedIndex) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a", "b"});
  WriteShard(d / "s2.safetensors", {"c"});
  WriteFile(d / "model.safetensors.index.json",
             R"({"metadata": {"total_size": 24}, "weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",)"
             R"( "c": "s2.safetensors"}})");
  auto store = TensorStore::Open(d.str());
  ASSERT_OK(store);
  EXPECT_EQ((*store)->num_tensors(), 3u);
  EXPECT_EQ((*store)->Names(), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ((*store)->files().size(), 2u);
  EXPECT_THAT(*(*store)->Find("c")->file, HasSubstr("s2.safetensors"));
  // The index path itself works too.
  EXPECT_OK(TensorStore::Open(d / "model.safetensors.index.json"));
}

TEST(TensorStore, SingleFileDirectory) {
  TempDir d;
  WriteShard(d / "model.safetensors", {"x"});
  auto store = TensorStore::Open(d.str());
  ASSERT_OK(store);
  EXPECT_NE((*store)->Find("x"), nullptr);
}

TEST(TensorStoreCorrupt, IndexNamesMissingShard) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a"});
  WriteFile(d / "model.safetensors.index.json",
             R"({"weight_map": {"a": "s1.safetensors", "layers.7.w": "s9.safetensors"}})");
  Status s = TensorStore::Open(d.str()).status();
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("s9.safetensors"),
                            HasSubstr("layers.7.w"), HasSubstr("does not exist")));
}

TEST(TensorStoreCorrupt, IndexNamesTensorShardLacks) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a"});
  WriteFile(d / "model.safetensors.index.json", R"({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}})");
  Status s = TensorStore::Open(d.str()).status();
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("'ghost'"), HasSubstr("s1.safetensors"), HasSubstr("does not contain")));
}

TEST(TensorStoreCorrupt, IndexPointsAtWrongShard) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a"});
  WriteShard(d / "s2.safetensors", {"b"});
  WriteFile(d / "model.safetensors.index.json", R"({"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors"}})");
  Status s = TensorStore::Open(d.str()).status();
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("'a'"), HasSubstr("s2.safetensors")));
}

TEST(TensorStoreCorrupt, DuplicateAcrossShards) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a", "dup.weight"});
  WriteShard(d / "s2.safetensors", {"dup.weight"});
  WriteFile(d / "model.safetensors.index.json",
             R"({"weight_map": {"a": "s1.safetensors", "dup.weight": "s2.safetensors"}})");
  Status s = TensorStore::Open(d.str()).status();
  EXPECT_THAT(Msg(s), AllOf(HasSubstr("'dup.weight'"), HasSubstr("s1.safetensors"), HasSubstr("s2.safetensors"),
                            HasSubstr("two shards")));
}

TEST(TensorStoreCorrupt, BadIndexFiles) {
  TempDir d;
  WriteShard(d / "s1.safetensors", {"a"});
  const std::string idx = d / "model.safetensors.index.json";
  WriteFile(idx, "{not json");
  EXPECT_THAT(Msg(TensorStore::Open(d.str()).status()),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("not valid JSON")));
  WriteFile(idx, R"({"metadata": {}})");
  EXPECT_THAT(Msg(TensorStore::Open(d.str()).status()), HasSubstr("weight_map"));
  WriteFile(idx, R"({"weight_map": {"a": 3}})");
  EXPECT_THAT(Msg(TensorStore::Open(d.str()).status()), AllOf(HasSubstr("'a'"), HasSubstr("not a file name")));
  WriteFile(idx, R"({"weight_map": {"a": "../../etc/passwd"}})");
  EXPECT_THAT(Msg(TensorStore::Open(d.str()).status()), AllOf(HasSubstr("'a'"), HasSubstr("invalid shard name")));
}

TEST(TensorStoreCorrupt, NothingThere) {
  TempDir d;
  EXPECT_THAT(Msg(TensorStore::Open(d.str()).status()), HasSubstr("no model.safetensors.index.json"));
  EXPECT_THAT(Msg(TensorStore::Open(d / "absent").status()), HasSubstr("absent"));
}

}  // namespace
}  // namespace numoe
