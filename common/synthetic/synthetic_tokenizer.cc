#include "common/synthetic/synthetic_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace numoe::synthetic {

// tests/data/tiny-v4/{tokenizer.json,tokenizer_config.json}, embedded by common/CMakeLists.txt (synthetic_data.cc).
extern const unsigned char kTinyTokenizerJson[];
extern const size_t kTinyTokenizerJsonSize;
extern const unsigned char kTinyTokenizerConfigJson[];
extern const size_t kTinyTokenizerConfigJsonSize;

namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

// DeepSeek V3/V4's pre-tokenizer (as in tests/data/tiny-v4/tokenizer.json).
constexpr const char* kPreTokenizer = R"json({"type": "Sequence", "pretokenizers": [
  {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
  {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, "behavior": "Isolated", "invert": false},
  {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
  {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})json";

constexpr const char* kTokenizerConfig = R"json({
 "tokenizer_class": "PreTrainedTokenizerFast",
 "model_max_length": 1048576,
 "add_bos_token": false,
 "add_eos_token": false,
 "bos_token": "<｜begin▁of▁sentence｜>",
 "eos_token": "<｜end▁of▁sentence｜>",
 "pad_token": "<｜end▁of▁sentence｜>",
 "unk_token": null
}
)json";

constexpr const char* kGenerationConfig = R"json({
  "bos_token_id": 0,
  "eos_token_id": 1,
  "do_sample": true,
  "temperature": 1.0,
  "top_p": 1.0
}
)json";

// DeepSeek's added tokens with known ids in the 129280-id vocabulary.
constexpr std::pair<int64_t, const char*> kKnownAdded[] = {
    {128799, "<｜dspark▁noise｜>"}, {128800, "<｜fim▁hole｜>"},   {128801, "<｜fim▁begin｜>"},
    {128802, "<｜fim▁end｜>"},      {128803, "<｜User｜>"},        {128804, "<｜Assistant｜>"},
    {128821, "<think>"},           {128822, "</think>"},          {128825, "｜DSML｜"},
    {128828, "<｜latest_reminder｜>"},
};

// UTF-8 of one code point.
std::string Utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: the byte-level alphabet, in its canonical order (printable bytes first).
std::vector<std::pair<int, std::string>> ByteAlphabet() {
  std::vector<std::pair<int, std::string>> out;
  std::vector<bool> printable(256, false);
  for (int b = 0; b < 256; ++b) printable[b] = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
  for (int b = 0; b < 256; ++b)
    if (printable[b]) out.push_back({b, Utf8(static_cast<uint32_t>(b))});
  uint32_t extra = 256;
  for (int b = 0; b < 256; ++b)
    if (!printable[b]) out.push_back({b, Utf8(extra++)});
  return out;
}

ojson AddedToken(int64_t id, const std::string& content) {
  return ojson{{"id", id},           {"content", content}, {"single_word", false}, {"lstrip", false},
               {"rstrip", false},    {"normalized", false}, {"special", true}};
}

Status WriteFile(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat(path.string(), ": cannot create"));
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.flush();
  if (!out) return absl::DataLossError(absl::StrCat(path.string(), ": write failed"));
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::string> SyntheticTokenizerJson(int64_t vocab_size) {
  if (vocab_size < 1024 || vocab_size >= (int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic tokenizer: vocab_size must be in [1024, 16777216) (got ", vocab_size, ")"));
  }
  const bool deepseek_ids = vocab_size >= 129000;
  const int64_t first_added = deepseek_ids ? 128000 : vocab_size - 32;

  // Added tokens: [first_added, vocab_size).
  std::map<int64_t, std::string> added = {{0, "<｜begin▁of▁sentence｜>"}, {1, "<｜end▁of▁sentence｜>"}, {2, "<｜▁pad▁｜>"}};
  if (deepseek_ids) {
    for (const auto& [id, content] : kKnownAdded) added[id] = content;
  } else {
    const char* named[] = {"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜dspark▁noise｜>", "<｜fim▁hole｜>"};
    int64_t id = first_added;
    for (const char* n : named) added[id++] = n;
  }
  for (int64_t id = first_added; id < vocab_size; ++id)
    if (!added.count(id)) added[id] = absl::StrCat("<｜place▁holder▁no▁", id - first_added, "｜>");

  // Vocabulary and merges, in id order.
  std::vector<std::string> tokens;  // index = id
  tokens.reserve(static_cast<size_t>(vocab_size));
  for (int64_t id = 0; id < 3; ++id) tokens.push_back(added[id]);
  for (const auto& [byte, text] : ByteAlphabet()) tokens.push_back(text);
  std::vector<std::pair<std::string, std::string>> merges;
  const size_t merge_budget = static_cast<size_t>(first_added) - tokens.size();
  auto merge = [&](const std::string& a, const std::string& b) {
    if (merges.size() >= merge_budget) return false;
    merges.push_back({a, b});
    tokens.push_back(a + b);
    return true;
  };
  const std::string space = "Ġ", newline = "Ċ";
  merge(space, space);
  merge(space + space, space + space);
  merge(newline, newline);
  for (char a = '0'; a <= '9'; ++a)
    for (char b = '0'; b <= '9'; ++b) merge(std::string(1, a), std::string(1, b));
  for (char a = '0'; a <= '9'; ++a)
    for (char b = '0'; b <= '9'; ++b)
      for (char c = '0'; c <= '9'; ++c) merge(std::string{a, b}, std::string(1, c));
  std::vector<std::string> level = {space};
  for (char c = 'A'; c <= 'Z'; ++c) level.push_back(std::string(1, c));
  for (char c = 'a'; c <= 'z'; ++c) level.push_back(std::string(1, c));
  while (merges.size() < merge_budget) {
    std::vector<std::string> next;
    for (const std::string& w : level) {
      for (char c = 'a'; c <= 'z'; ++c) {
        if (!merge(w, std::string(1, c))) break;
        next.push_back(w + c);
      }
      if (merges.size() >= merge_budget) break;
    }
    level = std::move(next);
  }
  for (int64_t id = first_added; id < vocab_size; ++id) tokens.push_back(added[id]);
  if (static_cast<int64_t>(tokens.size()) != vocab_size) {
    return absl::InternalError(absl::StrCat("synthetic tokenizer: built ", tokens.size(), " ids, wanted ", vocab_size));
  }

  // vocab in id order, as Hugging Face writes it; built as text because an ordered JSON object would make
  // 129280 insertions quadratic.
  auto quote = [](const std::string& t) { return ojson(t).dump(); };
  std::string vocab_text = "{";
  std::set<std::string> seen;
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (!seen.insert(tokens[id]).second) {
      return absl::InternalError(absl::StrCat("synthetic tokenizer: duplicate token ", tokens[id]));
    }
    absl::StrAppend(&vocab_text, id ? "," : "", quote(tokens[id]), ":", id);
  }
  vocab_text += "}";
  std::string merges_text = "[";
  for (size_t i = 0; i < merges.size(); ++i)
    absl::StrAppend(&merges_text, i ? "," : "", "[", quote(merges[i].first), ",", quote(merges[i].second), "]");
  merges_text += "]";
  ojson added_list = ojson::array();
  for (const auto& [id, content] : added) added_list.push_back(AddedToken(id, content));

  ojson j = ojson::object();
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = std::move(added_list);
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = ojson::parse(kPreTokenizer);
  j["post_processor"] = nullptr;
  j["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", nullptr},
                {"end_of_word_suffix", nullptr},
                {"fuse_unk", false},
                {"byte_fallback", false},
                {"ignore_merges", false},
                {"vocab", "@VOCAB@"},
                {"merges", "@MERGES@"}};
  std::string text = j.dump();
  // Splice the pre-built members in place of their placeholders (which occur once each).
  const std::string vocab_slot = quote("@VOCAB@"), merges_slot = quote("@MERGES@");
  text.replace(text.find(vocab_slot), vocab_slot.size(), vocab_text);
  text.replace(text.find(merges_slot), merges_slot.size(), merges_text);
  return text + "\n";
}

Status WriteSyntheticTokenizer(const std::string& dir, int64_t vocab_size) {
  ASSIGN_OR_RETURN(std::string json, SyntheticTokenizerJson(vocab_size));
  RETURN_IF_ERROR(WriteFile(fs::path(dir) / "tokenizer.json", json));
  RETURN_IF_ERROR(WriteFile(fs::path(dir) / "tokenizer_config.json", kTokenizerConfig));
  return WriteFile(fs::path(dir) / "generation_config.json", kGenerationConfig);
}

Status WriteTinyTokenizer(const std::string& dir) {
  RETURN_IF_ERROR(WriteFile(fs::path(dir) / "tokenizer.json",
                            std::string_view(reinterpret_cast<const char*>(kTinyTokenizerJson), kTinyTokenizerJsonSize)));
  RETURN_IF_ERROR(WriteFile(fs::path(dir) / "tokenizer_config.json",
                            std::string_view(reinterpret_cast<const char*>(kTinyTokenizerConfigJson),
                                             kTinyTokenizerConfigJsonSize)));
  return WriteFile(fs::path(dir) / "generation_config.json", kGenerationConfig);
}

}  // namespace numoe::synthetic
