// Constrained sampling: a JSON-schema compiler to a byte-level pushdown automaton, and the token mask it
// allows at each step, computed against a tokenizer's vocabulary.
//
// The constraint travels as text (a "grammar spec", a JSON object) from the router to whoever samples
// (numoe-gpu's sampler, model/sampling.h):
//   {"type": "json_object", "end": [ids]}                      any JSON object
//   {"type": "json_schema", "schema": {...}, "end": [ids]}     a value valid against the schema
//   {"type": "dsml_tool_call", "tools": [{"name": "N", "parameters": {schema}}, ...], "dsml": id, "end": [ids]}
//       one DSML tool call (docs/dsv4-chat-encoding.md §4.2) of one of the tools: `<｜DSML｜tool_calls>\n`,
//       one invoke with the tool's parameters in schema order (string="true" with raw text for a "string"
//       property, else string="false" with a JSON value), `</｜DSML｜tool_calls>`; `dsml` is the id of the
//       ｜DSML｜ token, which must be emitted as that token (-1: the tokenizer has none, the marker is text).
//       Raw string values hold no '<' (so the first "</｜DSML｜parameter>" ends them, as the parser reads it).
// `end` lists the token ids allowed once the value is complete (EOS, a stop token); then nothing else is.
// "think_end": id (any type) lets the output start with free text (reasoning) up to that token (</think>);
// the constrained value follows it.
//
// Schemas: type (string, number, integer, boolean, null, object, array, or a list of them), properties,
// required, additionalProperties (false, or absent), items, enum, const, anyOf, $ref to "#", "#/$defs/NAME"
// or "#/definitions/NAME", minLength / maxLength, minItems / maxItems, and the annotations title,
// description, default, examples, $schema, $id, $comment. Any other keyword is refused by name
// (InvalidArgument "response_format.json_schema: unsupported keyword 'pattern' at /properties/x").
// Objects are written with their properties in the schema's order (optional ones may be left out); a
// schema with no type (or true) allows any JSON value.
//
// Output is compact JSON with bounded whitespace: at most kMaxGrammarWhitespace whitespace bytes where JSON
// allows them (none before the value), numbers at most 16 integer and 16 fraction digits and a 3-digit
// exponent. Strings and arrays are as long as the schema allows (maxLength / maxItems bound them), so a
// value that must close within a token budget should bound them. Strings are valid UTF-8.
//
// Thread-safety: a Grammar is immutable after Compile except its mask cache, which is locked; a
// GrammarState is one sequence's and single-threaded.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace numoe::tokenizer {

class Tokenizer;

inline constexpr int kMaxGrammarWhitespace = 4;
// The largest grammar spec accepted (bytes of its text).
inline constexpr size_t kMaxGrammarSpecBytes = 64 * 1024;

// Every token's symbols, as a trie, for walking the automaton over the whole vocabulary at once.
class GrammarVocab {
 public:
  // model_vocab: the logits width (ids past the tokenizer's are never allowed).
  // Added and special tokens are each the one symbol kSymbolToken + id (allowed only where a grammar names
  // them, never inside a string or number).
  static std::shared_ptr<const GrammarVocab> FromTokenizer(const Tokenizer& tok, int64_t model_vocab);
  // From explicit byte strings (tests): tokens[i] is id i's bytes; an empty string is never allowed; ids in
  // `added` are the one symbol 256 + id.
  static std::shared_ptr<const GrammarVocab> FromBytes(const std::vector<std::string>& tokens,
                                                       std::span<const int32_t> added = {});
  int64_t size() const { return size_; }
  const std::vector<int32_t>& symbols(int32_t id) const { return tokens_[static_cast<size_t>(id)]; }

  // Symbols are bytes, or 256 + id for an added token.
  struct TrieNode {
    std::vector<int32_t> tokens;                      // ids whose symbols end here
    std::vector<std::pair<int32_t, int32_t>> children;  // (symbol, node)
  };
  const std::vector<TrieNode>& trie() const { return trie_; }

 private:
  int64_t size_ = 0;
  std::vector<std::vector<int32_t>> tokens_;
  std::vector<TrieNode> trie_;
};

// One frame of the automaton's stack.
struct GrammarFrame {
  int32_t node = 0, a = 0, b = 0, c = 0;
  auto operator<=>(const GrammarFrame&) const = default;
};
using GrammarStack = std::vector<GrammarFrame>;
// The automaton's state: every stack still alive (anyOf / optional properties are nondeterministic),
// sorted and without duplicates. Empty = dead (no continuation).
using GrammarStates = std::vector<GrammarStack>;

class Grammar {
 public:
  // Compiles a grammar spec (header comment) for `vocab`. InvalidArgument names the bad field or keyword.
  static StatusOr<std::shared_ptr<const Grammar>> Compile(std::string_view spec,
                                                          std::shared_ptr<const GrammarVocab> vocab);
  // Checks a response_format / tool schema without a vocabulary (the router). `field` prefixes errors.
  static Status CheckSchema(std::string_view schema_json, std::string_view field);

  GrammarStates Start() const;
  // Advances every stack by one symbol (a byte, or kSymbolToken + id of a special token the grammar names);
  // the result is sorted and deduplicated.
  static constexpr int kSymbolToken = 256;
  GrammarStates Feed(const GrammarStates& states, int symbol) const;
  // Whether the value may end here.
  bool CanEnd(const GrammarStates& states) const;
  // The tokens allowed from `states`, one bit per id of the vocabulary (bit i of word i / 64), cached by
  // state. `end` tokens are allowed exactly when CanEnd (or when nothing else is).
  std::shared_ptr<const std::vector<uint64_t>> Mask(const GrammarStates& states) const;
  bool IsEnd(int32_t token) const;
  const GrammarVocab& vocab() const { return *vocab_; }

  // Mask statistics since start (for the benchmark): masks computed (cache misses) and served from cache,
  // and the nanoseconds spent computing.
  struct MaskStats {
    uint64_t computed = 0, cached = 0, compute_ns = 0;
  };
  static MaskStats GlobalMaskStats();

  enum class Kind : uint8_t { kSeq, kAlt, kLit, kString, kNumber, kWs, kArray, kRef, kRaw, kUntil };
  struct Node {
    Kind kind = Kind::kSeq;
    std::vector<int32_t> kids;
    std::vector<int32_t> text;  // kLit: symbols
    int32_t min = 0;      // kString: minLength; kArray: minItems
    int32_t max = -1;     // -1 = unbounded
    bool integer = false; // kNumber
  };

 private:
  friend class GrammarBuilder;
  void FeedStack(GrammarStack s, int c, GrammarStates* out) const;
  void Walk(int32_t trie_node, const GrammarStates& states, std::vector<uint64_t>* mask) const;

  std::vector<Node> nodes_;
  int32_t root_ = 0;
  std::vector<int32_t> end_;
  std::shared_ptr<const GrammarVocab> vocab_;
  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const std::vector<uint64_t>>> cache_;
};

// One sequence's position in its grammar.
class GrammarState {
 public:
  explicit GrammarState(std::shared_ptr<const Grammar> g) : g_(std::move(g)), states_(g_->Start()) {}
  // The allowed tokens now (header of Grammar::Mask); after an end token only the end tokens.
  std::shared_ptr<const std::vector<uint64_t>> Mask() const;
  void Accept(int32_t token);
  bool finished() const { return finished_; }
  const GrammarStates& states() const { return states_; }
  const Grammar& grammar() const { return *g_; }

 private:
  std::shared_ptr<const Grammar> g_;
  GrammarStates states_;
  bool finished_ = false;
};

// Compiled grammars by spec text, for one vocabulary (numoe-gpu keeps one: choices and requests with the same
// response_format share the compiled grammar and its mask cache).
class GrammarCache {
 public:
  explicit GrammarCache(std::shared_ptr<const GrammarVocab> vocab) : vocab_(std::move(vocab)) {}
  StatusOr<std::shared_ptr<const Grammar>> Get(const std::string& spec);

 private:
  std::shared_ptr<const GrammarVocab> vocab_;
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<const Grammar>> grammars_;
};

inline bool MaskAllows(const std::vector<uint64_t>& mask, int32_t id) {
  return ((mask[static_cast<size_t>(id) >> 6] >> (id & 63)) & 1) != 0;
}

}  // namespace numoe::tokenizer
