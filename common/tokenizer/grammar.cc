#include "common/tokenizer/grammar.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/tokenizer/tokenizer.h"

namespace numoe::tokenizer {
namespace {

using json = nlohmann::ordered_json;
using Kind = Grammar::Kind;

constexpr int kEndSymbol = -1;
constexpr size_t kMaxStackDepth = 512;
constexpr size_t kMaxStates = 256;  // live stacks kept per state (anyOf / optional properties fan out)
constexpr size_t kMaxCachedMasks = 1 << 14;
constexpr int32_t kMaxIntDigits = 16, kMaxFracDigits = 16, kMaxExpDigits = 3;

std::atomic<uint64_t> g_computed{0}, g_cached{0}, g_compute_ns{0};

bool IsWs(int c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
bool IsDigit(int c) { return c >= '0' && c <= '9'; }
bool IsHex(int c) { return IsDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

void BuildTrie(const std::vector<std::vector<int32_t>>& tokens, std::vector<GrammarVocab::TrieNode>* trie) {
  trie->assign(1, {});
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (tokens[id].empty()) continue;
    int32_t at = 0;
    for (int32_t sym : tokens[id]) {
      auto& kids = (*trie)[static_cast<size_t>(at)].children;
      auto it = std::find_if(kids.begin(), kids.end(), [&](const auto& e) { return e.first == sym; });
      if (it != kids.end()) {
        at = it->second;
        continue;
      }
      const int32_t next = static_cast<int32_t>(trie->size());
      kids.emplace_back(sym, next);
      trie->emplace_back();
      at = next;
    }
    (*trie)[static_cast<size_t>(at)].tokens.push_back(static_cast<int32_t>(id));
  }
}

}  // namespace

std::shared_ptr<const GrammarVocab> GrammarVocab::FromTokenizer(const Tokenizer& tok, int64_t model_vocab) {
  auto v = std::make_shared<GrammarVocab>();
  v->size_ = model_vocab;
  v->tokens_.resize(static_cast<size_t>(model_vocab));
  const int64_t n = std::min<int64_t>(model_vocab, tok.vocab_size());
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = static_cast<int32_t>(i);
    auto& syms = v->tokens_[static_cast<size_t>(i)];
    if (tok.IsAddedToken(id) || tok.IsSpecialToken(id)) {
      syms.push_back(Grammar::kSymbolToken + id);
      continue;
    }
    for (char ch : tok.IdToBytes(id)) syms.push_back(static_cast<uint8_t>(ch));
  }
  BuildTrie(v->tokens_, &v->trie_);
  return v;
}

std::shared_ptr<const GrammarVocab> GrammarVocab::FromBytes(const std::vector<std::string>& tokens,
                                                           std::span<const int32_t> added) {
  auto v = std::make_shared<GrammarVocab>();
  v->size_ = static_cast<int64_t>(tokens.size());
  v->tokens_.resize(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (std::find(added.begin(), added.end(), static_cast<int32_t>(i)) != added.end()) {
      v->tokens_[i].push_back(Grammar::kSymbolToken + static_cast<int32_t>(i));
      continue;
    }
    for (char ch : tokens[i]) v->tokens_[i].push_back(static_cast<uint8_t>(ch));
  }
  BuildTrie(v->tokens_, &v->trie_);
  return v;
}

// ---- compiler ----

class GrammarBuilder {
 public:
  GrammarBuilder(Grammar* g, std::string field) : g_(g), field_(std::move(field)) {}

  int32_t Add(Grammar::Node n) {
    g_->nodes_.push_back(std::move(n));
    return static_cast<int32_t>(g_->nodes_.size() - 1);
  }
  int32_t Lit(std::string_view text) {
    Grammar::Node n{.kind = Kind::kLit};
    for (char ch : text) n.text.push_back(static_cast<uint8_t>(ch));
    if (n.text.empty()) return Seq({});
    return Add(std::move(n));
  }
  // An added token, or (id < 0: the tokenizer has none) its text.
  int32_t Token(int32_t id, std::string_view text) {
    if (id < 0) return Lit(text);
    return Add(Grammar::Node{.kind = Kind::kLit, .text = {Grammar::kSymbolToken + id}});
  }
  int32_t Dsml() { return Token(dsml_, "｜DSML｜"); }
  int32_t Seq(std::vector<int32_t> kids) { return Add(Grammar::Node{.kind = Kind::kSeq, .kids = std::move(kids)}); }
  int32_t Alt(std::vector<int32_t> kids) {
    if (kids.size() == 1) return kids[0];
    return Add(Grammar::Node{.kind = Kind::kAlt, .kids = std::move(kids)});
  }
  int32_t Ws() {
    if (ws_ < 0) ws_ = Add(Grammar::Node{.kind = Kind::kWs, .max = kMaxGrammarWhitespace});
    return ws_;
  }
  int32_t String(int32_t min = 0, int32_t max = -1) {
    return Add(Grammar::Node{.kind = Kind::kString, .min = min, .max = max});
  }
  int32_t Number(bool integer) { return Add(Grammar::Node{.kind = Kind::kNumber, .integer = integer}); }
  int32_t Array(int32_t item, int32_t min, int32_t max) {
    return Add(Grammar::Node{.kind = Kind::kArray, .kids = {item}, .min = min, .max = max});
  }

  // Any JSON value (json_object's members, untyped schemas).
  int32_t AnyValue() {
    if (any_ >= 0) return any_;
    any_ = Add(Grammar::Node{.kind = Kind::kRef});
    const int32_t obj = AnyObject();
    const int32_t v = Alt({obj, Array(any_, 0, -1), String(), Number(false), Lit("true"), Lit("false"), Lit("null")});
    g_->nodes_[static_cast<size_t>(any_)].kids = {v};
    return any_;
  }
  int32_t AnyObject() {
    if (any_obj_ >= 0) return any_obj_;
    any_obj_ = Add(Grammar::Node{.kind = Kind::kRef});
    const int32_t value = AnyValue();
    const int32_t member = Seq({String(), Ws(), Lit(":"), Ws(), value, Ws()});
    const int32_t tail = Add(Grammar::Node{.kind = Kind::kAlt});
    g_->nodes_[static_cast<size_t>(tail)].kids = {Lit("}"), Seq({Lit(","), Ws(), member, tail})};
    const int32_t obj = Seq({Lit("{"), Ws(), Alt({Lit("}"), Seq({member, tail})})});
    g_->nodes_[static_cast<size_t>(any_obj_)].kids = {obj};
    return any_obj_;
  }

  Status Bad(std::string_view path, std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(field_, ": ", std::string(what), " at ", path.empty() ? std::string("/") : std::string(path)));
  }

  // Properties in order, optional ones skippable. `member(j)` is the node of property j (key and value),
  // `first_sep` what comes before the first member, `sep` between members, `close` at the end.
  int32_t Members(size_t n, const std::vector<bool>& required, const std::vector<int32_t>& member, int32_t sep,
                  int32_t close) {
    // rest[i][first]: the members from i on; memoised.
    std::vector<std::array<int32_t, 2>> rest(n + 1, {-1, -1});
    std::function<int32_t(size_t, int)> build = [&](size_t i, int first) -> int32_t {
      if (rest[i][first] >= 0) return rest[i][first];
      std::vector<int32_t> alts;
      bool required_left = false;
      for (size_t j = i; j < n; ++j) {
        std::vector<int32_t> seq;
        if (!first && sep >= 0) seq.push_back(sep);
        seq.push_back(member[j]);
        seq.push_back(build(j + 1, 0));
        alts.push_back(Seq(std::move(seq)));
        if (required[j]) {
          required_left = true;
          break;
        }
      }
      if (!required_left) alts.push_back(close);
      return rest[i][first] = Alt(std::move(alts));
    };
    return build(0, 1);
  }

  StatusOr<int32_t> Schema(const json& s, const std::string& path) {
    if (++depth_ > 64) return Bad(path, "schema nested deeper than 64");
    struct Leave {
      int* d;
      ~Leave() { --*d; }
    } leave{&depth_};
    if (s.is_boolean()) {
      if (s.get<bool>()) return AnyValue();
      return Bad(path, "the schema false allows nothing");
    }
    if (!s.is_object()) return Bad(path, "a schema must be an object or a boolean");
    static const std::vector<std::string> kKnown = {
        "type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf", "$ref",
        "$defs", "definitions", "minLength", "maxLength", "minItems", "maxItems", "title", "description",
        "default", "examples", "$schema", "$id", "$comment"};
    for (const auto& [key, value] : s.items()) {
      if (std::find(kKnown.begin(), kKnown.end(), key) == kKnown.end()) {
        return Bad(path, absl::StrCat("unsupported keyword '", key, "'"));
      }
    }
    if (s.contains("$ref")) return Ref(s["$ref"], path);
    if (s.contains("const")) return Lit(s["const"].dump());
    if (s.contains("enum")) {
      const json& e = s["enum"];
      if (!e.is_array() || e.empty()) return Bad(path + "/enum", "enum must be a non-empty array");
      std::vector<int32_t> alts;
      for (const json& v : e) alts.push_back(Lit(v.dump()));
      return Alt(std::move(alts));
    }
    if (s.contains("anyOf")) {
      const json& a = s["anyOf"];
      if (!a.is_array() || a.empty()) return Bad(path + "/anyOf", "anyOf must be a non-empty array");
      std::vector<int32_t> alts;
      for (size_t i = 0; i < a.size(); ++i) {
        ASSIGN_OR_RETURN(int32_t k, Schema(a[i], absl::StrCat(path, "/anyOf/", i)));
        alts.push_back(k);
      }
      return Alt(std::move(alts));
    }
    if (!s.contains("type")) return AnyValue();
    const json& t = s["type"];
    if (t.is_string()) return Typed(s, t.get<std::string>(), path);
    if (!t.is_array() || t.empty()) return Bad(path + "/type", "type must be a string or a non-empty array of them");
    std::vector<int32_t> alts;
    for (const json& one : t) {
      if (!one.is_string()) return Bad(path + "/type", "type must be a string or a non-empty array of them");
      ASSIGN_OR_RETURN(int32_t k, Typed(s, one.get<std::string>(), path));
      alts.push_back(k);
    }
    return Alt(std::move(alts));
  }

  StatusOr<int32_t> Bound(const json& s, const char* key, const std::string& path, int32_t dflt) {
    if (!s.contains(key)) return dflt;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 20)) {
      return Bad(path + "/" + key, absl::StrCat(key, " must be an integer in [0, 1048576]"));
    }
    return static_cast<int32_t>(v.get<int64_t>());
  }

  StatusOr<int32_t> Typed(const json& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      ASSIGN_OR_RETURN(int32_t min, Bound(s, "minLength", path, 0));
      ASSIGN_OR_RETURN(int32_t max, Bound(s, "maxLength", path, -1));
      if (max >= 0 && min > max) return Bad(path, "minLength is more than maxLength");
      return String(min, max);
    }
    if (type == "number") return Number(false);
    if (type == "integer") return Number(true);
    if (type == "boolean") return Alt({Lit("true"), Lit("false")});
    if (type == "null") return Lit("null");
    if (type == "array") {
      ASSIGN_OR_RETURN(int32_t min, Bound(s, "minItems", path, 0));
      ASSIGN_OR_RETURN(int32_t max, Bound(s, "maxItems", path, -1));
      if (max >= 0 && min > max) return Bad(path, "minItems is more than maxItems");
      int32_t item = -1;
      if (s.contains("items")) {
        ASSIGN_OR_RETURN(item, Schema(s["items"], path + "/items"));
      } else {
        item = AnyValue();
      }
      return Array(item, min, max);
    }
    if (type == "object") return Object(s, path, /*dsml=*/false);
    return Bad(path + "/type", absl::StrCat("unknown type '", type, "'"));
  }

  // A JSON object, or (dsml) the parameters of a DSML invoke.
  StatusOr<int32_t> Object(const json& s, const std::string& path, bool dsml) {
    const json* props = s.contains("properties") ? &s["properties"] : nullptr;
    if (props != nullptr && !props->is_object()) return Bad(path + "/properties", "properties must be an object");
    if (s.contains("additionalProperties")) {
      const json& ap = s["additionalProperties"];
      const bool is_false = ap.is_boolean() && !ap.get<bool>();
      if (!is_false && (props != nullptr || dsml)) {
        return Bad(path, "unsupported keyword 'additionalProperties' (only false is supported with properties)");
      }
    }
    if (props == nullptr && !dsml) {
      if (s.contains("required")) return Bad(path, "required without properties");
      return AnyObject();
    }
    std::vector<std::string> names;
    if (props != nullptr) {
      for (const auto& [k, v] : props->items()) names.push_back(k);
    }
    std::vector<bool> required(names.size(), false);
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) return Bad(path + "/required", "required must be an array of property names");
      for (const json& name : r) {
        auto it = name.is_string() ? std::find(names.begin(), names.end(), name.get<std::string>()) : names.end();
        if (it == names.end()) {
          return Bad(path + "/required", absl::StrCat("required names ", name.dump(), ", which is not in properties"));
        }
        required[static_cast<size_t>(it - names.begin())] = true;
      }
    }
    std::vector<int32_t> member;
    for (const std::string& name : names) {
      const json& ps = (*props)[name];
      const std::string at = absl::StrCat(path, "/properties/", name);
      ASSIGN_OR_RETURN(int32_t value, Schema(ps, at));
      if (dsml) {
        const bool raw = ps.is_object() && ps.contains("type") && ps["type"].is_string() &&
                         ps["type"].get<std::string>() == "string" && !ps.contains("enum") && !ps.contains("const");
        const std::string open = absl::StrCat("parameter name=", json(name).dump(), " string=\"", raw ? "true" : "false", "\">");
        if (raw) {
          ASSIGN_OR_RETURN(int32_t min, Bound(ps, "minLength", at, 0));
          ASSIGN_OR_RETURN(int32_t max, Bound(ps, "maxLength", at, -1));
          value = Add(Grammar::Node{.kind = Kind::kRaw, .min = min, .max = max});
        }
        member.push_back(Seq({Lit("<"), Dsml(), Lit(open), value, Lit("</"), Dsml(), Lit("parameter>\n")}));
      } else {
        member.push_back(Seq({Lit(json(name).dump()), Ws(), Lit(":"), Ws(), value, Ws()}));
      }
    }
    if (dsml) {
      const int32_t close = Seq({Lit("</"), Dsml(), Lit("invoke>\n")});
      return Members(names.size(), required, member, -1, close);
    }
    const int32_t body = Members(names.size(), required, member, Seq({Lit(","), Ws()}), Lit("}"));
    return Seq({Lit("{"), Ws(), body});
  }

  StatusOr<int32_t> Ref(const json& ref, const std::string& path) {
    if (!ref.is_string()) return Bad(path + "/$ref", "$ref must be a string");
    const std::string r = ref.get<std::string>();
    auto found = refs_.find(r);
    if (found != refs_.end()) return found->second;
    const json* target = nullptr;
    if (r == "#") {
      target = root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        if (r.rfind(prefix, 0) != 0) continue;
        const std::string name = r.substr(std::string(prefix).size());
        const std::string key = std::string(prefix).substr(2, std::string(prefix).size() - 3);
        if (root_->contains(key) && (*root_)[key].is_object() && (*root_)[key].contains(name)) {
          target = &(*root_)[key][name];
        }
      }
    }
    if (target == nullptr) {
      return Bad(path + "/$ref", absl::StrCat("$ref ", ref.dump(), " names no definition (supported: \"#\", "
                                                                  "\"#/$defs/NAME\", \"#/definitions/NAME\")"));
    }
    const int32_t node = Add(Grammar::Node{.kind = Kind::kRef});
    refs_[r] = node;
    ASSIGN_OR_RETURN(int32_t k, Schema(*target, r.substr(1)));
    g_->nodes_[static_cast<size_t>(node)].kids = {k};
    return node;
  }

  StatusOr<int32_t> Root(const json& schema) {
    root_ = &schema;
    refs_.clear();
    return Schema(schema, "");
  }

  StatusOr<int32_t> ToolCall(const json& tools, int32_t dsml) {
    dsml_ = dsml;
    if (!tools.is_array() || tools.empty()) return Bad("/tools", "tools must be a non-empty array");
    std::vector<int32_t> invokes;
    for (size_t i = 0; i < tools.size(); ++i) {
      const json& t = tools[i];
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        return Bad(absl::StrCat("/tools/", i), "each tool needs a string name");
      }
      static const json kEmpty = json::object();
      const json& params = t.contains("parameters") ? t["parameters"] : kEmpty;
      if (!params.is_object()) return Bad(absl::StrCat("/tools/", i, "/parameters"), "parameters must be an object");
      if (params.contains("type") && params["type"] != "object") {
        return Bad(absl::StrCat("/tools/", i, "/parameters/type"), "tool parameters must be of type object");
      }
      root_ = &params;
      refs_.clear();
      const std::string open = absl::StrCat("invoke name=", json(t["name"].get<std::string>()).dump(), ">\n");
      ASSIGN_OR_RETURN(int32_t body, Object(params, absl::StrCat("/tools/", i, "/parameters"), /*dsml=*/true));
      invokes.push_back(Seq({Lit("<"), Dsml(), Lit(open), body}));
    }
    return Seq({Lit("<"), Dsml(), Lit("tool_calls>\n"), Alt(std::move(invokes)), Lit("</"), Dsml(),
                Lit("tool_calls>")});
  }

 private:
  Grammar* g_;
  std::string field_;
  const json* root_ = nullptr;
  std::map<std::string, int32_t> refs_;
  int32_t ws_ = -1, any_ = -1, any_obj_ = -1, dsml_ = -1;
  int depth_ = 0;
};

StatusOr<std::shared_ptr<const Grammar>> Grammar::Compile(std::string_view spec_text,
                                                          std::shared_ptr<const GrammarVocab> vocab) {
  if (spec_text.size() > kMaxGrammarSpecBytes) {
    return absl::InvalidArgumentError(absl::StrCat("grammar: ", spec_text.size(), " bytes; at most ", kMaxGrammarSpecBytes));
  }
  json spec = json::parse(spec_text, nullptr, /*allow_exceptions=*/false);
  if (!spec.is_object() || !spec.contains("type") || !spec["type"].is_string()) {
    return absl::InvalidArgumentError("grammar: not a JSON object with a string \"type\"");
  }
  auto g = std::make_shared<Grammar>();
  g->vocab_ = std::move(vocab);
  if (spec.contains("end")) {
    if (!spec["end"].is_array()) return absl::InvalidArgumentError("grammar.end must be an array of token ids");
    for (const json& id : spec["end"]) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || (g->vocab_ && id.get<int64_t>() >= g->vocab_->size())) {
        return absl::InvalidArgumentError(absl::StrCat("grammar.end: token id ", id.dump(), " is out of range"));
      }
      g->end_.push_back(id.get<int32_t>());
    }
  }
  const std::string type = spec["type"].get<std::string>();
  GrammarBuilder b(g.get(), type == "dsml_tool_call" ? "tools" : "response_format.json_schema");
  if (type == "json_object") {
    g->root_ = b.AnyObject();
  } else if (type == "json_schema") {
    if (!spec.contains("schema")) return absl::InvalidArgumentError("grammar: json_schema without \"schema\"");
    ASSIGN_OR_RETURN(g->root_, b.Root(spec["schema"]));
  } else if (type == "dsml_tool_call") {
    if (!spec.contains("dsml") || !spec["dsml"].is_number_integer()) {
      return absl::InvalidArgumentError("grammar: dsml_tool_call needs the \"dsml\" token id");
    }
    ASSIGN_OR_RETURN(g->root_, b.ToolCall(spec.value("tools", json()), spec["dsml"].get<int32_t>()));
  } else {
    return absl::InvalidArgumentError(absl::StrCat("grammar: unknown type \"", type, "\""));
  }
  if (spec.contains("think_end")) {
    if (!spec["think_end"].is_number_integer()) return absl::InvalidArgumentError("grammar.think_end must be a token id");
    const int32_t until = b.Add(Node{.kind = Kind::kUntil, .min = kSymbolToken + spec["think_end"].get<int32_t>()});
    g->root_ = b.Seq({until, g->root_});
  }
  return std::shared_ptr<const Grammar>(std::move(g));
}

Status Grammar::CheckSchema(std::string_view schema_json, std::string_view field) {
  json schema = json::parse(schema_json, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(std::string(field), ": not valid JSON"));
  Grammar g;
  GrammarBuilder b(&g, std::string(field));
  return b.Root(schema).status();
}

// ---- the automaton ----

GrammarStates Grammar::Start() const { return GrammarStates{GrammarStack{GrammarFrame{root_, 0, 0, 0}}}; }

void Grammar::FeedStack(GrammarStack s, int c, GrammarStates* out) const {
  for (;;) {
    if (s.empty()) {
      if (c == kEndSymbol) out->push_back(std::move(s));
      return;
    }
    if (s.size() > kMaxStackDepth || out->size() > kMaxStates) return;
    GrammarFrame& f = s.back();
    const Node& n = nodes_[static_cast<size_t>(f.node)];
    const bool byte = c >= 0 && c < 256;
    switch (n.kind) {
      case Kind::kSeq: {
        if (f.a >= static_cast<int32_t>(n.kids.size())) {
          s.pop_back();
          continue;
        }
        const int32_t kid = n.kids[static_cast<size_t>(f.a++)];
        if (f.a == static_cast<int32_t>(n.kids.size())) s.pop_back();  // the last child replaces its sequence
        s.push_back(GrammarFrame{kid, 0, 0, 0});
        continue;
      }
      case Kind::kRef:
        s.back() = GrammarFrame{n.kids[0], 0, 0, 0};
        continue;
      case Kind::kAlt: {
        if (n.kids.empty()) return;
        s.pop_back();
        for (size_t i = 0; i + 1 < n.kids.size(); ++i) {
          GrammarStack fork = s;
          fork.push_back(GrammarFrame{n.kids[i], 0, 0, 0});
          FeedStack(std::move(fork), c, out);
        }
        s.push_back(GrammarFrame{n.kids.back(), 0, 0, 0});
        continue;
      }
      case Kind::kLit:
        if (c != n.text[static_cast<size_t>(f.a)]) return;
        if (++f.a == static_cast<int32_t>(n.text.size())) s.pop_back();
        out->push_back(std::move(s));
        return;
      case Kind::kWs:
        if (byte && IsWs(c)) {
          if (f.a >= n.max) return;
          ++f.a;
          out->push_back(std::move(s));
          return;
        }
        s.pop_back();
        continue;
      case Kind::kRaw:  // any text (valid UTF-8, no added tokens, no '<') until the parent's next literal;
                        // b counts characters (minLength / maxLength)
        if (byte && c != '<' && !(c < 0x20 && c != '\n' && c != '\t' && c != '\r')) {
          const bool cont = (c & 0xC0) == 0x80;
          if (f.c > 0 ? cont : ((c < 0x80 || (c >= 0xC2 && c <= 0xF4)) && (n.max < 0 || f.b < n.max))) {
            GrammarStack stay = s;
            GrammarFrame& g = stay.back();
            if (g.c > 0) {
              --g.c;
            } else {
              ++g.b;
              if (c >= 0xC0) g.c = c >= 0xF0 ? 3 : c >= 0xE0 ? 2 : 1;
            }
            out->push_back(std::move(stay));
          }
        }
        if (f.c > 0 || f.b < n.min) return;  // inside a UTF-8 character, or too short
        s.pop_back();
        continue;
      case Kind::kUntil:  // anything but an end token, up to and including the symbol n.min
        if (c == kEndSymbol || (c >= kSymbolToken && IsEnd(c - kSymbolToken))) return;
        if (c == n.min) s.pop_back();
        out->push_back(std::move(s));
        return;
      case Kind::kString: {
        if (!byte) return;
        if (f.a == 0) {  // the opening quote
          if (c != '"') return;
          f.a = 1;
          out->push_back(std::move(s));
          return;
        }
        if (f.a == 1) {
          if ((f.c & 0xF) > 0) {  // a UTF-8 continuation byte, the first one range-checked for its lead
            int lo = 0x80, hi = 0xBF;
            switch (f.c >> 4) {
              case 1: lo = 0xA0; break;  // E0: no overlong
              case 2: hi = 0x9F; break;  // ED: no surrogates
              case 3: lo = 0x90; break;  // F0: no overlong
              case 4: hi = 0x8F; break;  // F4: <= U+10FFFF
              default: break;
            }
            if (c < lo || c > hi) return;
            f.c = (f.c & 0xF) - 1;
            out->push_back(std::move(s));
            return;
          }
          if (c == '"') {
            if (f.b < n.min) return;
            s.pop_back();
            out->push_back(std::move(s));
            return;
          }
          if (c < 0x20) return;
          if (n.max >= 0 && f.b >= n.max) return;
          if (c == '\\') {
            f.a = 2;
          } else if (c >= 0x80) {
            if (c >= 0xC2 && c <= 0xDF) {
              f.c = 1;
            } else if (c >= 0xE0 && c <= 0xEF) {
              f.c = 2 | (c == 0xE0 ? 1 << 4 : c == 0xED ? 2 << 4 : 0);
            } else if (c >= 0xF0 && c <= 0xF4) {
              f.c = 3 | (c == 0xF0 ? 3 << 4 : c == 0xF4 ? 4 << 4 : 0);
            } else {
              return;
            }
          }
          ++f.b;
          out->push_back(std::move(s));
          return;
        }
        if (f.a == 2) {  // after a backslash
          if (c == 'u') {
            f.a = 3;
          } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
            f.a = 1;
          } else {
            return;
          }
          out->push_back(std::move(s));
          return;
        }
        if (!IsHex(c)) return;  // \uXXXX
        f.a = f.a == 6 ? 1 : f.a + 1;
        out->push_back(std::move(s));
        return;
      }
      case Kind::kNumber: {
        const bool digit = byte && IsDigit(c);
        const bool exp = !n.integer && (c == 'e' || c == 'E');
        const bool dot = !n.integer && c == '.';
        auto take = [&](int32_t phase, int32_t count) {
          f.a = phase;
          f.b = count;
          out->push_back(std::move(s));
        };
        switch (f.a) {
          case 0:
            if (c == '-') return take(1, 0);
            [[fallthrough]];
          case 1:
            if (c == '0') return take(3, 0);
            if (digit) return take(2, 1);
            return;
          case 2:
            if (digit && f.b < kMaxIntDigits) return take(2, f.b + 1);
            if (dot) return take(4, 0);
            if (exp) return take(6, 0);
            break;
          case 3:
            if (dot) return take(4, 0);
            if (exp) return take(6, 0);
            break;
          case 4:
            if (digit) return take(5, 1);
            return;
          case 5:
            if (digit && f.b < kMaxFracDigits) return take(5, f.b + 1);
            if (exp) return take(6, 0);
            break;
          case 6:
            if (c == '+' || c == '-') return take(7, 0);
            [[fallthrough]];
          case 7:
            if (digit) return take(8, 1);
            return;
          case 8:
            if (digit && f.b < kMaxExpDigits) return take(8, f.b + 1);
            break;
          default:
            return;
        }
        if (digit) return;  // too many digits
        s.pop_back();       // the number is complete: the symbol is the parent's
        continue;
      }
      case Kind::kArray: {
        const int32_t item = n.kids[0];
        const bool more = n.max < 0 || f.b < n.max;
        if (f.a == 0) {
          if (c != '[') return;
          f.a = 1;
          out->push_back(std::move(s));
          return;
        }
        if (byte && IsWs(c)) {
          if (f.c >= kMaxGrammarWhitespace) return;
          ++f.c;
          out->push_back(std::move(s));
          return;
        }
        if (f.a == 2) {  // after an item
          if (c == ',' && more) {
            f.a = 3;
            f.c = 0;
            out->push_back(std::move(s));
          } else if (c == ']' && f.b >= n.min) {
            s.pop_back();
            out->push_back(std::move(s));
          }
          return;
        }
        if (f.a == 1 && c == ']') {  // right after '['
          if (n.min == 0) {
            s.pop_back();
            out->push_back(std::move(s));
          }
          return;
        }
        if (f.a == 1 && !more) return;
        f.a = 2;
        f.b += 1;
        f.c = 0;
        s.push_back(GrammarFrame{item, 0, 0, 0});
        continue;
      }
    }
    return;
  }
}

GrammarStates Grammar::Feed(const GrammarStates& states, int symbol) const {
  GrammarStates out;
  for (const GrammarStack& s : states) FeedStack(s, symbol, &out);
  if (out.size() > 1) {
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }
  return out;
}

bool Grammar::CanEnd(const GrammarStates& states) const {
  for (const GrammarStack& s : states) {
    GrammarStates out;
    FeedStack(s, kEndSymbol, &out);
    if (!out.empty()) return true;
  }
  return false;
}

bool Grammar::IsEnd(int32_t token) const { return std::find(end_.begin(), end_.end(), token) != end_.end(); }

void Grammar::Walk(int32_t trie_node, const GrammarStates& states, std::vector<uint64_t>* mask) const {
  for (const auto& [sym, child] : vocab_->trie()[static_cast<size_t>(trie_node)].children) {
    GrammarStates next = Feed(states, sym);
    if (next.empty()) continue;
    for (int32_t id : vocab_->trie()[static_cast<size_t>(child)].tokens) {
      (*mask)[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
    }
    Walk(child, next, mask);
  }
}

std::shared_ptr<const std::vector<uint64_t>> Grammar::Mask(const GrammarStates& states) const {
  std::string key;
  for (const GrammarStack& s : states) {
    const uint32_t n = static_cast<uint32_t>(s.size());
    key.append(reinterpret_cast<const char*>(&n), sizeof(n));
    key.append(reinterpret_cast<const char*>(s.data()), s.size() * sizeof(GrammarFrame));
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) {
      g_cached.fetch_add(1, std::memory_order_relaxed);
      return it->second;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto mask = std::make_shared<std::vector<uint64_t>>(static_cast<size_t>((vocab_->size() + 63) / 64), 0);
  bool any = false;
  if (!states.empty()) {
    Walk(0, states, mask.get());
    for (uint64_t w : *mask) any |= w != 0;
  }
  if (!any || CanEnd(states)) {
    for (int32_t id : end_) (*mask)[static_cast<size_t>(id) >> 6] |= uint64_t{1} << (id & 63);
  }
  g_computed.fetch_add(1, std::memory_order_relaxed);
  g_compute_ns.fetch_add(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                   std::chrono::steady_clock::now() - t0)
                                                   .count()),
                         std::memory_order_relaxed);
  std::lock_guard<std::mutex> lk(mu_);
  if (cache_.size() >= kMaxCachedMasks) cache_.clear();
  cache_.emplace(std::move(key), mask);
  return mask;
}

Grammar::MaskStats Grammar::GlobalMaskStats() {
  return MaskStats{g_computed.load(), g_cached.load(), g_compute_ns.load()};
}

std::shared_ptr<const std::vector<uint64_t>> GrammarState::Mask() const {
  if (finished_) return g_->Mask(GrammarStates{});  // dead: the end tokens only
  return g_->Mask(states_);
}

void GrammarState::Accept(int32_t token) {
  if (finished_) return;
  if (g_->IsEnd(token)) {
    finished_ = true;
    return;
  }
  if (token < 0 || token >= g_->vocab().size()) {
    states_.clear();
    return;
  }
  for (int32_t sym : g_->vocab().symbols(token)) {
    states_ = g_->Feed(states_, sym);
    if (states_.empty()) return;
  }
}

StatusOr<std::shared_ptr<const Grammar>> GrammarCache::Get(const std::string& spec) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = grammars_.find(spec);
  if (it != grammars_.end()) return it->second;
  ASSIGN_OR_RETURN(auto g, Grammar::Compile(spec, vocab_));
  if (grammars_.size() >= 256) grammars_.clear();
  grammars_.emplace(spec, g);
  return g;
}

}  // namespace numoe::tokenizer
