// Loading tokenizer.json (and tokenizer_config.json) into Tokenizer::Impl.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/tokenizer/tokenizer_impl.h"
#include "common/tokenizer/utf8.h"
#include "nlohmann/json.hpp"

namespace numoe::tokenizer {
namespace {

using json = nlohmann::json;

// GPT-2's regex, used by ByteLevel when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Rust regex `\w` (Unicode word characters), for added tokens with single_word.
constexpr std::string_view kWordCharPattern = R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])";

constexpr int32_t kMaxId = 1 << 24;  // sanity bound on ids: 16M slots

// DeepSeek's strings for the ids the server needs.
constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kUser = "<｜User｜>";
constexpr std::string_view kAssistant = "<｜Assistant｜>";
constexpr std::string_view kThink = "<think>";
constexpr std::string_view kEndThink = "</think>";

StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open: ", std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path.string(), ": read error"));
  return ss.str();
}

std::string Utf8Of(char32_t cp) {
  std::string s;
  AppendCodePoint(cp, &s);
  return s;
}

// The bytes a vocab string stands for: each character mapped back through the ByteLevel table; a string
// holding any character outside the table stands for its own UTF-8 (HF's ByteLevel decoder does this).
std::string VocabStringToBytes(std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    size_t len = 1;
    const char32_t cp = Utf8SequenceLength(token, i) > 0 ? DecodeCodePoint(token, i, &len) : 0xFFFFFFFF;
    const int b = cp == 0xFFFFFFFF ? -1 : CharToByte(cp);
    if (b < 0) return std::string(token);
    bytes.push_back(static_cast<char>(b));
    i += len;
  }
  return bytes;
}

class Loader {
 public:
  Loader(std::string source, Tokenizer::Impl* impl) : source_(std::move(source)), impl_(impl) {}

  Status Load(const json& root, std::string_view config_json, const std::string& config_source);

 private:
  Status Invalid(const std::string& field, const std::string& message) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": ", field, ": ", message));
  }
  Status Unsupported(const std::string& field, const std::string& message) const {
    return absl::UnimplementedError(absl::StrCat(source_, ": ", field, ": ", message));
  }
  // Reads an optional boolean member; absent or null gives `dflt`.
  StatusOr<bool> Bool(const json& obj, const char* key, bool dflt, const std::string& field) const {
    const auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) return Invalid(absl::StrCat(field, ".", key), "expected true or false");
    return it->get<bool>();
  }
  StatusOr<std::string> String(const json& obj, const char* key, const std::string& field) const {
    const auto it = obj.find(key);
    if (it == obj.end()) return Invalid(absl::StrCat(field, ".", key), "missing");
    if (!it->is_string()) return Invalid(absl::StrCat(field, ".", key), "expected a string");
    return it->get<std::string>();
  }
  StatusOr<int32_t> Id(const json& v, const std::string& field) const {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= kMaxId) {
      return Invalid(field, absl::StrCat("expected an id in [0, ", kMaxId, "), got ", v.dump()));
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

  Status LoadAddedTokens(const json& root);
  Status LoadNormalizer(const json& n, const std::string& field);
  Status LoadPreTokenizer(const json& p, const std::string& field);
  Status LoadModel(const json& model);
  Status LoadPostProcessor(const json& p, const std::string& field);
  Status LoadDecoder(const json& d, const std::string& field);
  Status BuildTables();
  Status LoadSpecialIds(std::string_view config_json, const std::string& config_source);

  std::string source_;
  Tokenizer::Impl* impl_;
  absl::flat_hash_map<std::string, int32_t> vocab_;
  bool saw_byte_level_ = false;
  bool saw_byte_level_decoder_ = false;
};

Status Loader::Load(const json& root, std::string_view config_json, const std::string& config_source) {
  if (!root.is_object()) return Invalid("(root)", "expected a JSON object");
  for (const char* key : {"truncation", "padding"}) {
    if (const auto it = root.find(key); it != root.end() && !it->is_null()) {
      NLOG(WARNING) << source_ << ": '" << key << "' is ignored (the server manages lengths itself)";
    }
  }
  RETURN_IF_ERROR(LoadAddedTokens(root));
  const auto nit = root.find("normalizer");
  RETURN_IF_ERROR(LoadNormalizer(nit == root.end() ? json() : *nit, "normalizer"));
  const auto pit = root.find("pre_tokenizer");
  RETURN_IF_ERROR(LoadPreTokenizer(pit == root.end() ? json() : *pit, "pre_tokenizer"));
  if (!saw_byte_level_) {
    return Unsupported("pre_tokenizer", "no ByteLevel step; only byte-level BPE tokenizers are supported");
  }
  const auto mit = root.find("model");
  if (mit == root.end() || !mit->is_object()) return Invalid("model", "missing or not an object");
  RETURN_IF_ERROR(LoadModel(*mit));
  const auto ppit = root.find("post_processor");
  RETURN_IF_ERROR(LoadPostProcessor(ppit == root.end() ? json() : *ppit, "post_processor"));
  const auto dit = root.find("decoder");
  RETURN_IF_ERROR(LoadDecoder(dit == root.end() ? json() : *dit, "decoder"));
  if (!saw_byte_level_decoder_) return Unsupported("decoder", "a ByteLevel decoder is required");
  RETURN_IF_ERROR(BuildTables());
  return LoadSpecialIds(config_json, config_source);
}

Status Loader::LoadAddedTokens(const json& root) {
  const auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_array()) return Invalid("added_tokens", "expected an array");
  bool any_single_word = false;
  absl::flat_hash_map<std::string, int32_t> contents;
  absl::flat_hash_set<int32_t> ids;
  for (size_t i = 0; i < it->size(); ++i) {
    const json& t = (*it)[i];
    const std::string field = absl::StrCat("added_tokens[", i, "]");
    if (!t.is_object()) return Invalid(field, "expected an object");
    AddedToken tok;
    const auto idit = t.find("id");
    if (idit == t.end()) return Invalid(field + ".id", "missing");
    ASSIGN_OR_RETURN(tok.id, Id(*idit, field + ".id"));
    ASSIGN_OR_RETURN(tok.content, String(t, "content", field));
    if (tok.content.empty()) return Invalid(field + ".content", "empty");
    if (FindInvalidUtf8(tok.content) != std::string::npos) return Invalid(field + ".content", "invalid UTF-8");
    ASSIGN_OR_RETURN(tok.special, Bool(t, "special", false, field));
    ASSIGN_OR_RETURN(tok.single_word, Bool(t, "single_word", false, field));
    ASSIGN_OR_RETURN(tok.lstrip, Bool(t, "lstrip", false, field));
    ASSIGN_OR_RETURN(tok.rstrip, Bool(t, "rstrip", false, field));
    ASSIGN_OR_RETURN(tok.normalized, Bool(t, "normalized", !tok.special, field));
    any_single_word |= tok.single_word;
    if (const auto [c, inserted] = contents.emplace(tok.content, tok.id); !inserted) {
      return Invalid(field + ".content", absl::StrCat("'", tok.content, "' is already added as id ", c->second));
    }
    if (!ids.insert(tok.id).second) return Invalid(field + ".id", absl::StrCat("id ", tok.id, " is used twice"));
    impl_->added.push_back(std::move(tok));
  }
  // HF builds its matchers from the special tokens first, then the others; with leftmost-longest matching
  // the order only matters for identical strings, which are rejected above.
  for (size_t i = 0; i < impl_->added.size(); ++i) {
    const AddedToken& tok = impl_->added[i];
    (tok.normalized ? impl_->normalized_trie : impl_->raw_trie).Add(tok.content, static_cast<int32_t>(i));
  }
  if (any_single_word) {
    ASSIGN_OR_RETURN(impl_->word_char, Regex::Compile(kWordCharPattern, false, "single_word check"));
  }
  return absl::OkStatus();
}

Status Loader::LoadNormalizer(const json& n, const std::string& field) {
  if (n.is_null()) return absl::OkStatus();
  if (!n.is_object()) return Invalid(field, "expected an object or null");
  ASSIGN_OR_RETURN(const std::string type, String(n, "type", field));
  if (type == "Sequence") {
    const auto it = n.find("normalizers");
    if (it == n.end() || !it->is_array()) return Invalid(field + ".normalizers", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(LoadNormalizer((*it)[i], absl::StrCat(field, ".normalizers[", i, "]")));
    }
    return absl::OkStatus();
  }
  return Unsupported(field + ".type", absl::StrCat("normalizer '", type, "' is not supported"));
}

Status Loader::LoadPreTokenizer(const json& p, const std::string& field) {
  if (p.is_null()) return absl::OkStatus();
  if (!p.is_object()) return Invalid(field, "expected an object or null");
  ASSIGN_OR_RETURN(const std::string type, String(p, "type", field));
  if (type == "Sequence") {
    const auto it = p.find("pretokenizers");
    if (it == p.end() || !it->is_array()) return Invalid(field + ".pretokenizers", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(LoadPreTokenizer((*it)[i], absl::StrCat(field, ".pretokenizers[", i, "]")));
    }
    return absl::OkStatus();
  }
  if (type == "Split") {
    // Splits run on raw bytes here; after ByteLevel they would see the mapped characters instead.
    if (saw_byte_level_) return Unsupported(field, "a Split after ByteLevel is not supported");
    const auto pat = p.find("pattern");
    if (pat == p.end() || !pat->is_object()) return Invalid(field + ".pattern", "expected an object");
    bool literal = false;
    std::string pattern;
    if (const auto r = pat->find("Regex"); r != pat->end() && r->is_string()) {
      pattern = r->get<std::string>();
    } else if (const auto s = pat->find("String"); s != pat->end() && s->is_string()) {
      pattern = s->get<std::string>();
      literal = true;
    } else {
      return Invalid(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
    }
    if (pattern.empty()) return Invalid(field + ".pattern", "empty pattern");
    SplitStep step;
    ASSIGN_OR_RETURN(step.regex, Regex::Compile(pattern, literal, absl::StrCat(source_, ": ", field, ".pattern")));
    ASSIGN_OR_RETURN(const std::string behavior, String(p, "behavior", field));
    if (behavior == "Removed") {
      step.behavior = SplitBehavior::kRemoved;
    } else if (behavior == "Isolated") {
      step.behavior = SplitBehavior::kIsolated;
    } else if (behavior == "MergedWithPrevious") {
      step.behavior = SplitBehavior::kMergedWithPrevious;
    } else if (behavior == "MergedWithNext") {
      step.behavior = SplitBehavior::kMergedWithNext;
    } else if (behavior == "Contiguous") {
      step.behavior = SplitBehavior::kContiguous;
    } else {
      return Invalid(field + ".behavior", absl::StrCat("unknown behavior '", behavior, "'"));
    }
    ASSIGN_OR_RETURN(step.invert, Bool(p, "invert", false, field));
    impl_->splits.push_back(std::move(step));
    return absl::OkStatus();
  }
  if (type == "ByteLevel") {
    if (saw_byte_level_) return Unsupported(field, "more than one ByteLevel step");
    ASSIGN_OR_RETURN(const bool prefix_space, Bool(p, "add_prefix_space", true, field));
    if (prefix_space) return Unsupported(field + ".add_prefix_space", "true is not supported");
    ASSIGN_OR_RETURN(const bool use_regex, Bool(p, "use_regex", true, field));
    if (use_regex) {
      SplitStep step;
      ASSIGN_OR_RETURN(step.regex,
                       Regex::Compile(kGpt2Pattern, false, absl::StrCat(source_, ": ", field, " (GPT-2 regex)")));
      impl_->splits.push_back(std::move(step));
    }
    saw_byte_level_ = true;
    return absl::OkStatus();
  }
  return Unsupported(field + ".type", absl::StrCat("pre-tokenizer '", type, "' is not supported"));
}

Status Loader::LoadModel(const json& m) {
  const auto tit = m.find("type");
  // HF accepts a BPE model without "type" (it tries each model in turn); so do we.
  const std::string type = tit != m.end() && tit->is_string() ? tit->get<std::string>() : "BPE";
  if (type != "BPE") return Unsupported("model.type", absl::StrCat("'", type, "' is not supported (only BPE)"));
  ASSIGN_OR_RETURN(const bool byte_fallback, Bool(m, "byte_fallback", false, "model"));
  if (byte_fallback) return Unsupported("model.byte_fallback", "true is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const auto it = m.find(key); it != m.end() && !it->is_null() && !(it->is_string() && it->empty())) {
      return Unsupported(absl::StrCat("model.", key), "not supported");
    }
  }
  if (const auto it = m.find("dropout"); it != m.end() && it->is_number() && it->get<double>() > 0) {
    NLOG(WARNING) << source_ << ": model.dropout is ignored at inference";
  }
  ASSIGN_OR_RETURN(const bool ignore_merges, Bool(m, "ignore_merges", false, "model"));
  impl_->bpe.set_ignore_merges(ignore_merges);

  const auto vit = m.find("vocab");
  if (vit == m.end() || !vit->is_object()) return Invalid("model.vocab", "missing or not an object");
  vocab_.reserve(vit->size());
  absl::flat_hash_map<int32_t, std::string> seen_ids;
  seen_ids.reserve(vit->size());
  for (const auto& [token, idv] : vit->items()) {
    const std::string field = absl::StrCat("model.vocab['", token, "']");
    ASSIGN_OR_RETURN(const int32_t id, Id(idv, field));
    if (const auto [it, inserted] = seen_ids.emplace(id, token); !inserted) {
      return Invalid(field, absl::StrCat("id ", id, " is also used by '", it->second, "'"));
    }
    vocab_.emplace(token, id);
  }

  std::vector<int32_t> byte_ids(256, -1);
  for (int b = 0; b < 256; ++b) {
    const auto it = vocab_.find(Utf8Of(ByteToChar()[b]));
    if (it != vocab_.end()) byte_ids[b] = it->second;
  }
  impl_->bpe.SetByteIds(byte_ids);
  if (ignore_merges) {
    for (const auto& [token, id] : vocab_) impl_->bpe.SetWholeWord(VocabStringToBytes(token), id);
  }

  if (const auto it = m.find("unk_token"); it != m.end() && !it->is_null()) {
    if (!it->is_string()) return Invalid("model.unk_token", "expected a string or null");
    const auto u = vocab_.find(it->get<std::string>());
    if (u == vocab_.end()) return Invalid("model.unk_token", absl::StrCat("'", it->get<std::string>(), "' is not in model.vocab"));
    ASSIGN_OR_RETURN(const bool fuse, Bool(m, "fuse_unk", false, "model"));
    impl_->bpe.set_unk(u->second, fuse);
  }

  const auto mit = m.find("merges");
  if (mit == m.end() || mit->is_null()) return absl::OkStatus();  // a vocab of bytes only
  if (!mit->is_array()) return Invalid("model.merges", "expected an array");
  std::string left, right;
  for (size_t i = 0; i < mit->size(); ++i) {
    const json& e = (*mit)[i];
    const std::string field = absl::StrCat("model.merges[", i, "]");
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return Invalid(field, absl::StrCat("expected \"left right\", got \"", s, "\""));
      }
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      return Invalid(field, "expected \"left right\" or [\"left\", \"right\"]");
    }
    const auto l = vocab_.find(left);
    if (l == vocab_.end()) return Invalid(field, absl::StrCat("token '", left, "' is not in model.vocab"));
    const auto r = vocab_.find(right);
    if (r == vocab_.end()) return Invalid(field, absl::StrCat("token '", right, "' is not in model.vocab"));
    const auto merged = vocab_.find(left + right);
    if (merged == vocab_.end()) {
      return Invalid(field, absl::StrCat("merged token '", left, right, "' is not in model.vocab"));
    }
    impl_->bpe.AddMerge(l->second, r->second, static_cast<uint32_t>(i), merged->second);
  }
  return absl::OkStatus();
}

Status Loader::LoadPostProcessor(const json& p, const std::string& field) {
  if (p.is_null()) return absl::OkStatus();
  if (!p.is_object()) return Invalid(field, "expected an object or null");
  ASSIGN_OR_RETURN(const std::string type, String(p, "type", field));
  if (type == "ByteLevel") return absl::OkStatus();  // only adjusts offsets, which we do not report
  if (type == "Sequence") {
    const auto it = p.find("processors");
    if (it == p.end() || !it->is_array()) return Invalid(field + ".processors", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(LoadPostProcessor((*it)[i], absl::StrCat(field, ".processors[", i, "]")));
    }
    return absl::OkStatus();
  }
  if (type != "TemplateProcessing") {
    return Unsupported(field + ".type", absl::StrCat("post-processor '", type, "' is not supported"));
  }
  const auto single = p.find("single");
  if (single == p.end() || !single->is_array()) return Invalid(field + ".single", "expected an array");
  const auto specials = p.find("special_tokens");
  std::vector<int32_t> prefix, suffix;
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const json& item = (*single)[i];
    const std::string ifield = absl::StrCat(field, ".single[", i, "]");
    if (item.is_object() && item.contains("Sequence")) {
      if (seen_sequence) return Unsupported(ifield, "more than one Sequence in the single template");
      seen_sequence = true;
      continue;
    }
    if (!item.is_object() || !item.contains("SpecialToken") || !item["SpecialToken"].is_object()) {
      return Invalid(ifield, "expected {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    ASSIGN_OR_RETURN(const std::string name, String(item["SpecialToken"], "id", ifield + ".SpecialToken"));
    if (specials == p.end() || !specials->is_object() || !specials->contains(name)) {
      return Invalid(field + ".special_tokens", absl::StrCat("no entry for '", name, "'"));
    }
    const json& ids = (*specials)[name]["ids"];
    if (!ids.is_array()) return Invalid(absl::StrCat(field, ".special_tokens['", name, "'].ids"), "expected an array");
    for (const json& idv : ids) {
      ASSIGN_OR_RETURN(const int32_t id, Id(idv, absl::StrCat(field, ".special_tokens['", name, "'].ids")));
      (seen_sequence ? suffix : prefix).push_back(id);
    }
  }
  if (!seen_sequence) return Invalid(field + ".single", "no {\"Sequence\": ...} item");
  // A later processor wraps the output of the earlier ones.
  prefix.insert(prefix.end(), impl_->prefix_ids.begin(), impl_->prefix_ids.end());
  impl_->prefix_ids = std::move(prefix);
  impl_->suffix_ids.insert(impl_->suffix_ids.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

Status Loader::LoadDecoder(const json& d, const std::string& field) {
  if (d.is_null()) return absl::OkStatus();
  if (!d.is_object()) return Invalid(field, "expected an object or null");
  ASSIGN_OR_RETURN(const std::string type, String(d, "type", field));
  if (type == "ByteLevel") {
    saw_byte_level_decoder_ = true;
    return absl::OkStatus();
  }
  if (type == "Sequence") {
    const auto it = d.find("decoders");
    if (it == d.end() || !it->is_array()) return Invalid(field + ".decoders", "expected an array");
    for (size_t i = 0; i < it->size(); ++i) {
      RETURN_IF_ERROR(LoadDecoder((*it)[i], absl::StrCat(field, ".decoders[", i, "]")));
    }
    return absl::OkStatus();
  }
  return Unsupported(field + ".type", absl::StrCat("decoder '", type, "' is not supported (only ByteLevel)"));
}

Status Loader::BuildTables() {
  int32_t max_id = -1;
  for (const auto& [token, id] : vocab_) max_id = std::max(max_id, id);
  for (const AddedToken& t : impl_->added) max_id = std::max(max_id, t.id);
  for (int32_t id : impl_->prefix_ids) max_id = std::max(max_id, id);
  for (int32_t id : impl_->suffix_ids) max_id = std::max(max_id, id);
  const auto n = static_cast<size_t>(max_id + 1);
  impl_->id_to_token.assign(n, "");
  impl_->id_bytes.assign(n, "");
  impl_->id_flags.assign(n, 0);
  impl_->token_to_id.reserve(vocab_.size() + impl_->added.size());
  for (const auto& [token, id] : vocab_) {
    impl_->id_to_token[id] = token;
    impl_->id_bytes[id] = VocabStringToBytes(token);
    impl_->id_flags[id] = Tokenizer::Impl::kPresent;
    impl_->token_to_id[token] = id;
  }
  for (const AddedToken& t : impl_->added) {
    impl_->id_to_token[t.id] = t.content;
    impl_->id_bytes[t.id] = t.content;
    impl_->id_flags[t.id] = Tokenizer::Impl::kPresent | Tokenizer::Impl::kAdded |
                            (t.special ? Tokenizer::Impl::kSpecial : 0);
    impl_->token_to_id[t.content] = t.id;
  }
  for (const auto* ids : {&impl_->prefix_ids, &impl_->suffix_ids}) {
    for (int32_t id : *ids) {
      if (!impl_->has(id)) return Invalid("post_processor", absl::StrCat("id ", id, " is not in the vocabulary"));
    }
  }
  return absl::OkStatus();
}

Status Loader::LoadSpecialIds(std::string_view config_json, const std::string& config_source) {
  std::string bos(kBos), eos(kEos);
  if (!config_json.empty()) {
    json cfg;
    try {
      cfg = json::parse(config_json);
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(config_source, ": invalid JSON: ", e.what()));
    }
    if (!cfg.is_object()) return absl::InvalidArgumentError(absl::StrCat(config_source, ": expected a JSON object"));
    for (auto [key, out] : {std::pair<const char*, std::string*>{"bos_token", &bos}, {"eos_token", &eos}}) {
      const auto it = cfg.find(key);
      if (it == cfg.end() || it->is_null()) continue;
      if (it->is_string()) {
        *out = it->get<std::string>();
      } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
        *out = (*it)["content"].get<std::string>();
      } else {
        return absl::InvalidArgumentError(absl::StrCat(config_source, ": ", key, ": expected a string or {\"content\": ...}"));
      }
    }
  }
  const auto lookup = [this](std::string_view s) {
    const auto it = impl_->token_to_id.find(absl::string_view(s.data(), s.size()));
    return it == impl_->token_to_id.end() ? -1 : it->second;
  };
  SpecialTokenIds& ids = impl_->special;
  ids.bos = lookup(bos);
  ids.eos = lookup(eos);
  ids.user = lookup(kUser);
  ids.assistant = lookup(kAssistant);
  ids.think = lookup(kThink);
  ids.end_think = lookup(kEndThink);
  return absl::OkStatus();
}

}  // namespace

const std::array<char32_t, 256>& ByteToChar() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

int CharToByte(char32_t c) {
  static const std::array<int16_t, 324> inverse = [] {
    std::array<int16_t, 324> inv;
    inv.fill(-1);
    for (int b = 0; b < 256; ++b) inv[ByteToChar()[b]] = static_cast<int16_t>(b);
    return inv;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

namespace {

StatusOr<std::unique_ptr<Tokenizer>> Build(std::string_view json_text, const std::string& source,
                                           std::string_view config_json, const std::string& config_source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  auto impl = std::make_unique<Tokenizer::Impl>();
  impl->source = source;
  Loader loader(source, impl.get());
  RETURN_IF_ERROR(loader.Load(root, config_json, config_source));
  return std::make_unique<Tokenizer>(std::move(impl));
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text, const std::string& source,
                                                         std::string_view config_json) {
  return Build(json_text, source, config_json, "tokenizer_config.json");
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file(path);
  if (fs::is_directory(file, ec)) file /= "tokenizer.json";
  if (!fs::exists(file, ec)) {
    return absl::NotFoundError(absl::StrCat(file.string(), ": not found (expected a tokenizer.json file or a "
                                            "directory holding one)"));
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFile(file));
  std::string config;
  const fs::path config_path = file.parent_path() / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    ASSIGN_OR_RETURN(config, ReadFile(config_path));
  }
  return Build(text, file.string(), config, config_path.string());
}

}  // namespace numoe::tokenizer
