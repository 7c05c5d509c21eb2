// Tokenizer tests. Golden ids and texts come from tests/data/tiny-v4/tokenizer_cases.json, which the
// Hugging Face `tokenizers` library produced; nothing here compares against numbers our code computed.
#include "common/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "common/tokenizer/utf8.h"
#include "nlohmann/json.hpp"
#include "tests/support/status_matchers.h"

namespace numoe::tokenizer {
namespace {

using json = nlohmann::json;

const std::string kTiny = std::string(NUMOE_TEST_DATA) + "/tiny-v4";
const std::string kDemo = std::string(NUMOE_TEST_DATA) + "/demo-v4";

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::unique_ptr<Tokenizer> MustLoad(const std::string& path) {
  auto tok = Tokenizer::Load(path);
  EXPECT_OK(tok);
  return tok.ok() ? std::move(tok).value() : nullptr;
}

std::vector<int32_t> MustEncode(const Tokenizer& tok, std::string_view text, const EncodeOptions& o = {}) {
  auto ids = tok.Encode(text, o);
  EXPECT_OK(ids);
  return ids.ok() ? *ids : std::vector<int32_t>{};
}

struct Case {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

std::vector<Case> LoadCases() {
  const json j = json::parse(ReadText(kTiny + "/tokenizer_cases.json"));
  std::vector<Case> cases;
  for (const json& c : j.at("cases")) {
    cases.push_back({c.at("text").get<std::string>(), c.at("ids").get<std::vector<int32_t>>(),
                     c.at("decoded").get<std::string>()});
  }
  return cases;
}

TEST(Tokenizer, AllGoldenCasesMatchHuggingFace) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const std::vector<Case> cases = LoadCases();
  ASSERT_EQ(cases.size(), 25u);
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(::testing::Message() << "case " << i << ": " << c.text);
    EXPECT_EQ(MustEncode(*tok, c.text), c.ids);
    EXPECT_EQ(tok->Decode(c.ids), c.decoded);
  }
}

TEST(Tokenizer, LoadsFromFileOrDirectoryAndDemoModelIsTheSame) {
  auto from_dir = MustLoad(kTiny);
  auto from_file = MustLoad(kTiny + "/tokenizer.json");
  auto demo = MustLoad(kDemo);
  ASSERT_NE(from_dir, nullptr);
  ASSERT_NE(from_file, nullptr);
  ASSERT_NE(demo, nullptr);
  EXPECT_EQ(demo->vocab_size(), 1024);
  EXPECT_EQ(from_file->vocab_size(), 1024);
  for (const Case& c : LoadCases()) {
    EXPECT_EQ(MustEncode(*demo, c.text), c.ids) << c.text;
    EXPECT_EQ(MustEncode(*from_file, c.text), c.ids) << c.text;
  }
}

TEST(Tokenizer, SpecialTokenIdsAndLookups) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const SpecialTokenIds& s = tok->special_ids();
  EXPECT_EQ(s.bos, 0);
  EXPECT_EQ(s.eos, 1);
  EXPECT_EQ(s.user, 2);
  EXPECT_EQ(s.assistant, 3);
  EXPECT_EQ(s.think, 4);
  EXPECT_EQ(s.end_think, 5);
  EXPECT_EQ(tok->SpecialTokenId("bos"), 0);
  EXPECT_EQ(tok->SpecialTokenId("User"), 2);
  EXPECT_EQ(tok->SpecialTokenId("Assistant"), 3);
  EXPECT_EQ(tok->SpecialTokenId("</think>"), 5);
  EXPECT_EQ(tok->SpecialTokenId("<｜dspark▁noise｜>"), 6);
  EXPECT_EQ(tok->SpecialTokenId("<｜fim▁hole｜>"), 7);
  EXPECT_EQ(tok->SpecialTokenId("nonsense"), std::nullopt);
  EXPECT_EQ(tok->SpecialTokenId("!"), std::nullopt);  // in the vocab but not an added token

  EXPECT_EQ(tok->TokenToId("<｜User｜>"), 2);
  EXPECT_EQ(tok->TokenToId("!"), 8);
  EXPECT_EQ(tok->TokenToId("not-a-token"), std::nullopt);
  EXPECT_EQ(tok->IdToToken(2), "<｜User｜>");
  EXPECT_EQ(tok->IdToToken(8), "!");
  EXPECT_EQ(tok->IdToToken(1024), std::nullopt);
  EXPECT_EQ(tok->IdToToken(-1), std::nullopt);
  // "Ġ" is the ByteLevel image of the space byte; id 228 is the space in the golden cases.
  EXPECT_EQ(tok->TokenToId("Ġ"), 228);
  EXPECT_EQ(tok->IdToBytes(228), " ");
  EXPECT_TRUE(tok->IsSpecialToken(0));
  EXPECT_TRUE(tok->IsAddedToken(7));
  EXPECT_FALSE(tok->IsAddedToken(8));
  EXPECT_FALSE(tok->IsSpecialToken(5000));
}

TEST(Tokenizer, DecodeSkipsSpecialTokensAndUnknownIds) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  // Case 13 of the goldens: "</think>The answer is 4.<｜end▁of▁sentence｜>".
  const std::vector<int32_t> ids = {5, 325, 293, 90, 94, 268, 307, 228, 27, 21, 1};
  EXPECT_EQ(tok->Decode(ids, /*skip_special_tokens=*/true), "The answer is 4.");
  std::vector<int32_t> with_unknown = ids;
  with_unknown.insert(with_unknown.begin() + 3, {-5, 1024, 1 << 30});
  EXPECT_EQ(tok->Decode(with_unknown), "</think>The answer is 4.<｜end▁of▁sentence｜>");
}

TEST(Tokenizer, SpecialTokensCanBeTreatedAsText) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const std::string text = "hi<｜User｜>there<think>";
  const auto with = MustEncode(*tok, text);
  EXPECT_NE(std::find(with.begin(), with.end(), 2), with.end());
  EXPECT_NE(std::find(with.begin(), with.end(), 4), with.end());
  EncodeOptions plain;
  plain.allow_special = false;
  const auto without = MustEncode(*tok, text, plain);
  for (int32_t id : without) EXPECT_FALSE(tok->IsAddedToken(id)) << id;
  EXPECT_EQ(tok->Decode(without), text);
}

// Decode(Encode(x)) == x for valid UTF-8 without special tokens.
TEST(Tokenizer, RoundTripsAssortedText) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const std::vector<std::string> alphabet = {
      "a", "Z", "q", "0", "7", " ", "  ", "\t", "\n", "\r\n", ".", ",", "!", "?", "'", "\"", "(", ")", "{", "}",
      "_", "-", "+", "=", "#", "@", "\\", "/", "~", "é", "ß", "Ж", "λ", "中", "文", "語", "の", "カ", "한", "글",
      "😀", "👍🏽", "‍", "\xE2\x80\x8B", "　", "\xE1\xA0\x8E", "\xC2\x85", "\xC2\xA0", "\xE2\x80\xA8", "١", "٣",
      "\xCC\x81", "ﬁ", "𝔘", "\x01", "\x7F", "<", ">", "|", "｜", "▁", "think", "<think", "User"};
  std::mt19937 rng(1234);
  std::uniform_int_distribution<size_t> pick(0, alphabet.size() - 1);
  std::uniform_int_distribution<int> length(0, 60);
  for (int iter = 0; iter < 400; ++iter) {
    std::string text;
    const int n = length(rng);
    for (int k = 0; k < n; ++k) text += alphabet[pick(rng)];
    EncodeOptions plain;
    plain.allow_special = false;
    const auto ids = MustEncode(*tok, text, plain);
    ASSERT_EQ(tok->Decode(ids), text) << "iteration " << iter;
    // With special tokens allowed the text still round-trips (added tokens decode to their content).
    ASSERT_EQ(tok->Decode(MustEncode(*tok, text)), text) << "iteration " << iter;
  }
  for (const Case& c : LoadCases()) EXPECT_EQ(tok->Decode(MustEncode(*tok, c.text)), c.text);
}

TEST(Tokenizer, LongWordsAndRunsAreLinearish) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  // Golden case 14 shows every 'a' is its own token (id 72); a 200k-byte word must give 200k of them.
  const std::string word(200000, 'a');
  const auto ids = MustEncode(*tok, word);
  ASSERT_EQ(ids.size(), word.size());
  EXPECT_TRUE(std::all_of(ids.begin(), ids.end(), [](int32_t id) { return id == 72; }));
  const std::string spaces = std::string(100000, ' ') + "x" + std::string(50000, '\n');
  EXPECT_EQ(tok->Decode(MustEncode(*tok, spaces)), spaces);
  std::string cjk;
  for (int i = 0; i < 30000; ++i) cjk += "中文分词";
  EXPECT_EQ(tok->Decode(MustEncode(*tok, cjk)), cjk);
}

// The rule: each ill-formed subsequence becomes U+FFFD before encoding (default), or InvalidArgument
// naming the offset with InvalidUtf8::kError.
TEST(Tokenizer, InvalidUtf8InputIsReplacedOrRejected) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const std::string fffd = "\xEF\xBF\xBD";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a\xFF" "b", "a" + fffd + "b"},
      {"\x80", fffd},
      {"x\xE4\xB8", "x" + fffd},                        // truncated 3-byte sequence: one U+FFFD
      {"\xE4\xB8" "y", fffd + "y"},
      {"\xC0\xAF", fffd + fffd},                        // overlong encoding: two bytes, two U+FFFD
      {"\xED\xA0\x80", fffd + fffd + fffd},             // a UTF-16 surrogate
      {"\xF4\x90\x80\x80", fffd + fffd + fffd + fffd},  // above U+10FFFF
      {"ok\xF0\x9F\x98", "ok" + fffd},                  // emoji cut short
      {std::string("nul\0byte", 8), std::string("nul\0byte", 8)},
  };
  for (const auto& [input, replaced] : cases) {
    const auto ids = MustEncode(*tok, input);
    EXPECT_EQ(ids, MustEncode(*tok, replaced));
    EXPECT_EQ(tok->Decode(ids), replaced);
  }
  EncodeOptions strict;
  strict.invalid_utf8 = InvalidUtf8::kError;
  const auto bad = tok->Encode("abc\xFF", strict);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("byte offset 3"), std::string::npos) << bad.status();
  EXPECT_OK(tok->Encode("abc", strict));
}

TEST(Tokenizer, DecodeReplacesBrokenBytes) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  // Find the single-byte tokens for 0xE4 and 0x80 through the public byte view.
  int32_t lead = -1, cont = -1;
  for (int32_t id = 0; id < tok->vocab_size(); ++id) {
    if (tok->IdToBytes(id) == "\xE4") lead = id;
    if (tok->IdToBytes(id) == "\x80") cont = id;
  }
  ASSERT_GE(lead, 0);
  ASSERT_GE(cont, 0);
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{cont}), fffd);
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{lead, 95}), fffd + "x");  // 95 is "x" in the goldens
  EXPECT_EQ(tok->Decode(std::vector<int32_t>{lead, 2, cont}), fffd + "<｜User｜>" + fffd);
}

void ExpectStreamMatchesDecode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip, bool* held) {
  StreamDecoder dec(tok, skip);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = dec.Add(id);
    EXPECT_EQ(FindInvalidUtf8(piece), std::string::npos) << "a chunk carried a partial character";
    if (dec.pending_bytes() > 0) *held = true;
    streamed += piece;
  }
  streamed += dec.Finish();
  EXPECT_EQ(dec.pending_bytes(), 0u);
  EXPECT_EQ(streamed, tok.Decode(ids, skip));
}

TEST(StreamDecoder, MultiByteCharactersSplitAcrossTokens) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  for (const std::string text : {"Emoji: 😀🚀👍🏽 and ZWJ 👨‍👩‍👧", "中文分词测试：你好世界。", "안녕하세요, 세계!",
                                 "日本語のテキスト<think>とカタカナ</think>、ひらがな。"}) {
    const auto ids = MustEncode(*tok, text);
    bool held = false;
    ExpectStreamMatchesDecode(*tok, ids, false, &held);
    EXPECT_TRUE(held) << "expected at least one token to end inside a character: " << text;
    ExpectStreamMatchesDecode(*tok, ids, true, &held);
    StreamDecoder dec(*tok);
    std::string out;
    for (int32_t id : ids) out += dec.Add(id);
    out += dec.Finish();
    EXPECT_EQ(out, text);
  }
  for (const Case& c : LoadCases()) {
    bool held = false;
    ExpectStreamMatchesDecode(*tok, c.ids, false, &held);
    ExpectStreamMatchesDecode(*tok, c.ids, true, &held);
  }
}

TEST(StreamDecoder, HoldsIncompleteBytesAndFlushesThemAtTheEnd) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const auto ids = MustEncode(*tok, "😀");
  ASSERT_GE(ids.size(), 2u);  // the golden emoji case spells it in several byte tokens
  StreamDecoder dec(*tok);
  for (size_t i = 0; i + 1 < ids.size(); ++i) EXPECT_EQ(dec.Add(ids[i]), "");
  EXPECT_GT(dec.pending_bytes(), 0u);
  EXPECT_EQ(dec.Add(ids.back()), "😀");
  // Cut short: the held bytes come out as one U+FFFD at Finish().
  EXPECT_EQ(dec.Add(ids[0]), "");
  EXPECT_EQ(dec.Finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(dec.Finish(), "");
  // A special token ends a partial character.
  EXPECT_EQ(dec.Add(ids[0]), "");
  EXPECT_EQ(dec.Add(1), "\xEF\xBF\xBD<｜end▁of▁sentence｜>");
  StreamDecoder skipping(*tok, /*skip_special_tokens=*/true);
  EXPECT_EQ(skipping.Add(1), "");
  EXPECT_EQ(skipping.Add(-3), "");
}

TEST(Tokenizer, ConcurrentEncodesAgree) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const std::vector<Case> cases = LoadCases();
  std::vector<std::thread> threads;
  std::vector<int> failures(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        for (size_t i = 0; i < cases.size(); ++i) {
          const Case& c = cases[(i + t * 7) % cases.size()];
          auto ids = tok->Encode(c.text);
          if (!ids.ok() || *ids != c.ids) ++failures[t];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

// ---- Synthetic tokenizer.json variants: added-token flags, post-processor, errors ------------------

json TinyJson() { return json::parse(ReadText(kTiny + "/tokenizer.json")); }

std::unique_ptr<Tokenizer> FromJsonOrDie(const json& j) {
  auto tok = Tokenizer::FromJson(j.dump(), "synthetic.json");
  EXPECT_OK(tok);
  return tok.ok() ? std::move(tok).value() : nullptr;
}

json AddedEntry(int id, const std::string& content, bool special, bool lstrip = false, bool rstrip = false,
                bool single_word = false, bool normalized = false) {
  return json{{"id", id},         {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
              {"rstrip", rstrip}, {"normalized", normalized}, {"special", special}};
}

TEST(AddedTokens, LongestMatchWins) {
  json j = TinyJson();
  j["added_tokens"].push_back(AddedEntry(1024, "<think", false));
  j["added_tokens"].push_back(AddedEntry(1025, "<thinker>", false));
  auto tok = FromJsonOrDie(j);
  ASSERT_NE(tok, nullptr);
  auto base = MustLoad(kTiny);
  EXPECT_EQ(MustEncode(*tok, "<think>"), std::vector<int32_t>({4}));
  EXPECT_EQ(MustEncode(*tok, "<thinker>"), std::vector<int32_t>({1025}));
  std::vector<int32_t> expect = {1024};
  for (int32_t id : MustEncode(*base, "er")) expect.push_back(id);
  EXPECT_EQ(MustEncode(*tok, "<thinker"), expect);
  EXPECT_EQ(tok->vocab_size(), 1026);
}

TEST(AddedTokens, LstripRstripAndSingleWordFlags) {
  json j = TinyJson();
  j["added_tokens"].push_back(AddedEntry(1024, "<mask>", true, /*lstrip=*/true));
  j["added_tokens"].push_back(AddedEntry(1025, "<eot>", true, false, /*rstrip=*/true));
  j["added_tokens"].push_back(AddedEntry(1026, "cat", false, false, false, /*single_word=*/true, true));
  auto tok = FromJsonOrDie(j);
  auto base = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  const auto cat = [](std::vector<int32_t> a, const std::vector<int32_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  // lstrip: the spaces before <mask> belong to the token.
  EXPECT_EQ(MustEncode(*tok, "I saw a  <mask> x"),
            cat(cat(MustEncode(*base, "I saw a"), {1024}), MustEncode(*base, " x")));
  // rstrip: the whitespace after <eot> belongs to the token.
  EXPECT_EQ(MustEncode(*tok, "end<eot> \n next"), cat(cat(MustEncode(*base, "end"), {1025}), MustEncode(*base, "next")));
  // single_word: "cat" alone is the token; inside "concatenate" or next to a letter or digit it is not.
  EXPECT_EQ(MustEncode(*tok, "a cat."), cat(cat(MustEncode(*base, "a "), {1026}), MustEncode(*base, ".")));
  EXPECT_EQ(MustEncode(*tok, "concatenate"), MustEncode(*base, "concatenate"));
  EXPECT_EQ(MustEncode(*tok, "cats"), MustEncode(*base, "cats"));
  EXPECT_EQ(MustEncode(*tok, "2cat"), MustEncode(*base, "2cat"));
  EXPECT_EQ(MustEncode(*tok, "cat"), std::vector<int32_t>({1026}));
}

TEST(PostProcessor, TemplateProcessingAddsBosOnlyWhenAsked) {
  json j = TinyJson();
  j["post_processor"] = json::parse(R"({
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<｜begin▁of▁sentence｜>", "type_id": 0}},
               {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [],
    "special_tokens": {"<｜begin▁of▁sentence｜>": {"id": "<｜begin▁of▁sentence｜>", "ids": [0],
                                                 "tokens": ["<｜begin▁of▁sentence｜>"]}}})");
  auto tok = FromJsonOrDie(j);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(MustEncode(*tok, "Hello, world!"), std::vector<int32_t>({0, 47, 477, 86, 19, 707, 8}));
  EncodeOptions raw;
  raw.add_special_tokens = false;
  EXPECT_EQ(MustEncode(*tok, "Hello, world!", raw), std::vector<int32_t>({47, 477, 86, 19, 707, 8}));
}

TEST(PreTokenizer, SplitBehaviors) {
  // Expected pieces: the HF tokenizers documentation's own example for SplitDelimiterBehavior.
  const json j = TinyJson();
  const auto with_behavior = [&](const std::string& behavior, bool invert) {
    json k = j;
    k["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"String": "-"}, "behavior": ")" + behavior + R"(", "invert": )" +
                                     (invert ? "true" : "false") + R"(},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})");
    return FromJsonOrDie(k);
  };
  using Pieces = std::vector<std::string>;
  const std::vector<std::pair<std::string, Pieces>> expected = {
      {"Removed", {"the", "final", "countdown"}},
      {"Isolated", {"the", "-", "final", "-", "-", "countdown"}},
      {"MergedWithPrevious", {"the-", "final-", "-", "countdown"}},
      {"MergedWithNext", {"the", "-final", "-", "-countdown"}},
      {"Contiguous", {"the", "-", "final", "--", "countdown"}},
  };
  for (const auto& [behavior, pieces] : expected) {
    auto tok = with_behavior(behavior, false);
    ASSERT_NE(tok, nullptr);
    auto got = tok->PreTokenize("the-final--countdown");
    ASSERT_OK(got);
    EXPECT_EQ(*got, pieces) << behavior;
    // BPE never merges across pieces, so the ids are the concatenation of the pieces' own ids.
    std::vector<int32_t> ids;
    for (const std::string& p : pieces) {
      for (int32_t id : MustEncode(*tok, p)) ids.push_back(id);
    }
    EXPECT_EQ(MustEncode(*tok, "the-final--countdown"), ids) << behavior;
  }
  // invert flips which parts count as matches, so Removed drops the words and keeps each "-".
  auto inverted = with_behavior("Removed", true);
  ASSERT_NE(inverted, nullptr);
  EXPECT_EQ(*inverted->PreTokenize("the-final--countdown"), Pieces({"-", "-", "-"}));
}

TEST(PreTokenizer, DeepSeekSplitsKeepAddedTokensWhole) {
  auto tok = MustLoad(kTiny);
  ASSERT_NE(tok, nullptr);
  // \p{N}{1,3} isolates digit triples; the CJK run is its own piece; `\s+(?!\S)` leaves the last space
  // of a run to the following word; added tokens are never split.
  auto got = tok->PreTokenize("ab 12345 中文x  y<｜User｜>z");
  ASSERT_OK(got);
  EXPECT_EQ(*got, std::vector<std::string>({"ab", " ", "123", "45", " ", "中文", "x", " ", " y", "<｜User｜>", "z"}));
}

Status LoadError(const json& j) { return Tokenizer::FromJson(j.dump(), "bad.json").status(); }

void ExpectError(const Status& s, absl::StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s;
}

TEST(Tokenizer, LoadErrorsNameTheFileAndField) {
  ExpectError(Tokenizer::Load("/nonexistent/dir").status(), absl::StatusCode::kNotFound, "/nonexistent/dir");
  ExpectError(Tokenizer::FromJson("{\"model\": ", "trunc.json").status(), absl::StatusCode::kInvalidArgument,
              "trunc.json: invalid JSON");
  ExpectError(Tokenizer::FromJson("[1,2]", "arr.json").status(), absl::StatusCode::kInvalidArgument, "arr.json");

  json j = TinyJson();
  j["model"]["type"] = "WordPiece";
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "bad.json: model.type");

  j = TinyJson();
  j["model"]["merges"][3] = json::array({"Ġ", "no-such-token"});
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "model.merges[3]");
  j["model"]["merges"][3] = "only-one-part";
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "model.merges[3]");
  j["model"]["merges"][3] = 17;
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "model.merges[3]");
  j["model"]["merges"][3] = json::array({"a", "b"});  // both exist, "ab" may not: then the merge is bad
  if (!j["model"]["vocab"].contains("ab")) {
    ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "merged token 'ab'");
  }

  j = TinyJson();
  j["model"].erase("vocab");
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "model.vocab");
  j = TinyJson();
  j["model"]["vocab"]["!"] = "eight";
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "model.vocab['!']");
  j = TinyJson();
  j["model"]["vocab"]["!"] = 9;  // duplicates the id of '"'
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "is also used by");

  j = TinyJson();
  j["added_tokens"][1].erase("content");
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "added_tokens[1].content");
  j = TinyJson();
  j["added_tokens"][2]["special"] = "yes";
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "added_tokens[2].special");

  j = TinyJson();
  j["pre_tokenizer"]["pretokenizers"][2]["pattern"]["Regex"] = "(unclosed";
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "pre_tokenizer.pretokenizers[2].pattern");
  j = TinyJson();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Sideways";
  ExpectError(LoadError(j), absl::StatusCode::kInvalidArgument, "pre_tokenizer.pretokenizers[0].behavior");
  j = TinyJson();
  j["pre_tokenizer"]["pretokenizers"][0]["type"] = "Metaspace";
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "Metaspace");
  j = TinyJson();
  j["pre_tokenizer"] = nullptr;
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "ByteLevel");
  j = TinyJson();
  j["normalizer"] = json{{"type", "NFKC"}};
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "normalizer");
  j = TinyJson();
  j["decoder"] = json{{"type", "WordPiece"}};
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "decoder");
  j = TinyJson();
  j["model"]["byte_fallback"] = true;
  ExpectError(LoadError(j), absl::StatusCode::kUnimplemented, "model.byte_fallback");

  ExpectError(Tokenizer::FromJson(TinyJson().dump(), "ok.json", "{not json").status(),
              absl::StatusCode::kInvalidArgument, "tokenizer_config.json");
}

TEST(Tokenizer, ConfigChoosesBosAndEos) {
  auto tok = Tokenizer::FromJson(TinyJson().dump(), "x.json",
                                 R"({"bos_token": {"content": "<｜User｜>"}, "eos_token": "<think>"})");
  ASSERT_OK(tok);
  EXPECT_EQ((*tok)->special_ids().bos, 2);
  EXPECT_EQ((*tok)->special_ids().eos, 4);
}

TEST(Utf8, LossyDecodingFollowsMaximalSubparts) {
  std::string out;
  EXPECT_EQ(AppendUtf8Lossy("ab\xE4\xB8", /*final=*/false, &out), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(AppendUtf8Lossy("\xF0\x9F\x98\x80\xF0", false, &out), 1u);
  EXPECT_EQ(out, "😀");
  out.clear();
  EXPECT_EQ(AppendUtf8Lossy("\xE0\x80", false, &out), 0u);  // E0 80 can never be valid: emitted now
  EXPECT_EQ(out, "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(FindInvalidUtf8("héllo"), std::string::npos);
  EXPECT_EQ(FindInvalidUtf8("hé\xFFllo"), 3u);
}

}  // namespace
}  // namespace numoe::tokenizer
