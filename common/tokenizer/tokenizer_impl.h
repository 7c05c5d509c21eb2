// Internals of Tokenizer shared by tokenizer.cc (encode/decode) and tokenizer_load.cc (tokenizer.json).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "common/tokenizer/bpe.h"
#include "common/tokenizer/pcre_regex.h"
#include "common/tokenizer/tokenizer.h"

namespace numoe::tokenizer {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// Byte trie over added-token contents, answering "longest token starting here" (with a first-byte filter
// so most positions cost one table lookup). Leftmost-longest scanning on top of it reproduces HF's
// Aho-Corasick MatchKind::LeftmostLongest.
class AddedTokenTrie {
 public:
  void Add(std::string_view content, int32_t token_index);
  bool empty() const { return nodes_.size() <= 1; }
  bool MayStart(uint8_t b) const { return first_[b]; }
  // Index of the longest token that is a prefix of text[pos..], or -1; *len gets its length.
  int32_t LongestAt(std::string_view text, size_t pos, size_t* len) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> next;  // sorted by byte
    int32_t token = -1;
  };
  std::vector<Node> nodes_{1};
  std::array<bool, 256> first_{};
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One regex split of the pre-tokenizer (HF Split, or ByteLevel's own regex when use_regex=true).
struct SplitStep {
  std::unique_ptr<Regex> regex;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

using Range = std::pair<size_t, size_t>;  // [begin, end) byte offsets

// Everything one Encode call writes. Pooled so concurrent Encodes never share one.
struct EncodeScratch {
  MatchScratch match;
  BpeScratch bpe;
  std::vector<Range> pieces, next_pieces, matches;
  std::vector<std::pair<Range, bool>> marked;  // pieces with "is a match" flags
};

class ScratchPool {
 public:
  class Lease {
   public:
    Lease(ScratchPool* pool, std::unique_ptr<EncodeScratch> s) : pool_(pool), s_(std::move(s)) {}
    ~Lease() { pool_->Return(std::move(s_)); }
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    EncodeScratch* get() const { return s_.get(); }

   private:
    ScratchPool* pool_;
    std::unique_ptr<EncodeScratch> s_;
  };
  Lease Acquire();

 private:
  void Return(std::unique_ptr<EncodeScratch> s);
  static constexpr size_t kMaxIdle = 64;  // beyond this, returned scratches are freed
  std::mutex mu_;
  std::vector<std::unique_ptr<EncodeScratch>> idle_;
};

struct Tokenizer::Impl {
  std::string source;  // file name used in messages

  // Added tokens, matched on the raw text (non-normalized) and then on the remaining pieces (normalized).
  std::vector<AddedToken> added;
  AddedTokenTrie raw_trie, normalized_trie;
  std::unique_ptr<Regex> word_char;  // Rust regex `\w`, only built when some token is single_word

  std::vector<SplitStep> splits;
  BpeModel bpe;

  // Post-processor (applied when add_special_tokens).
  std::vector<int32_t> prefix_ids, suffix_ids;

  // Lookups.
  absl::flat_hash_map<std::string, int32_t> token_to_id;  // vocab strings and added contents
  std::vector<std::string> id_to_token;                   // "" for holes
  std::vector<std::string> id_bytes;                      // what each id decodes to
  std::vector<uint8_t> id_flags;                          // kPresent | kAdded | kSpecial
  static constexpr uint8_t kPresent = 1, kAdded = 2, kSpecial = 4;
  SpecialTokenIds special;

  mutable ScratchPool pool;

  bool has(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < id_flags.size() && (id_flags[id] & kPresent) != 0;
  }
};

// GPT-2's reversible byte <-> printable-character mapping used by the ByteLevel pre-tokenizer and decoder.
const std::array<char32_t, 256>& ByteToChar();
// Inverse; -1 for characters that are not the image of a byte.
int CharToByte(char32_t c);

}  // namespace numoe::tokenizer
