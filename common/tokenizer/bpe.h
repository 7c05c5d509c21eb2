// Byte-level BPE merging (internal to numoe_tokenizer).
//
// Words are raw byte strings (the ByteLevel pre-tokenizer's byte -> char mapping is applied to the
// vocabulary once at load, not to every word). Merging follows HF tokenizers exactly: a min-heap of
// candidate pairs ordered by (merge rank, position), stale entries skipped when the pair under them has
// changed. O(n log n) per word, so a pathological 1 MB "word" is fine.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace numoe::tokenizer {

// Reusable per-thread buffers for BpeModel::Encode, plus a cache of recently seen words.
class BpeScratch {
 public:
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // neighbours in the live list, -1 at the ends
    bool live;
  };
  struct Candidate {
    uint32_t rank;
    uint32_t pos;
    int32_t new_id;
  };
  std::vector<Symbol> symbols;
  std::vector<Candidate> heap;

  // Word cache: bytes -> span of `cache_ids`. Bounded; cleared wholesale when full.
  struct Span {
    uint32_t offset, size;
  };
  absl::flat_hash_map<std::string, Span> cache;
  std::vector<int32_t> cache_ids;
};

class BpeModel {
 public:
  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };

  BpeModel() { byte_ids_.fill(-1); }

  // byte_ids[b] = id of the single byte b, or -1 when the vocabulary lacks it.
  void SetByteIds(const std::vector<int32_t>& byte_ids);
  // Later duplicates of a pair overwrite earlier ones (as HF's HashMap collect does).
  void AddMerge(int32_t left, int32_t right, uint32_t rank, int32_t new_id);
  void SetWholeWord(std::string bytes, int32_t id) { whole_words_[std::move(bytes)] = id; }
  void set_ignore_merges(bool v) { ignore_merges_ = v; }
  void set_unk(int32_t unk_id, bool fuse_unk) {
    unk_id_ = unk_id;
    fuse_unk_ = fuse_unk;
  }

  // Appends the ids of `word` (non-empty raw bytes) to *out.
  void Encode(std::string_view word, BpeScratch* scratch, std::vector<int32_t>* out) const;

  // Words longer than this are not cached (they are rare and would crowd the cache).
  static constexpr size_t kMaxCachedWordBytes = 256;
  static constexpr size_t kMaxCacheEntries = 1 << 16;

 private:
  void MergeWord(std::string_view word, BpeScratch* scratch, std::vector<int32_t>* out) const;
  const Merge* FindMerge(int32_t left, int32_t right) const {
    const auto it = merges_.find(Key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  }
  static uint64_t Key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  std::array<int32_t, 256> byte_ids_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  absl::flat_hash_map<std::string, int32_t> whole_words_;  // raw bytes -> id, for ignore_merges
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
};

}  // namespace numoe::tokenizer
