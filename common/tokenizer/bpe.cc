#include "common/tokenizer/bpe.h"

#include <algorithm>

namespace numoe::tokenizer {
namespace {

// std::push_heap builds a max-heap; "greater" puts the lowest (rank, pos) on top, as HF's Merge ordering.
struct LowerRankFirst {
  bool operator()(const BpeScratch::Candidate& a, const BpeScratch::Candidate& b) const {
    if (a.rank != b.rank) return a.rank > b.rank;
    return a.pos > b.pos;
  }
};

}  // namespace

void BpeModel::SetByteIds(const std::vector<int32_t>& byte_ids) {
  for (int b = 0; b < 256; ++b) byte_ids_[b] = byte_ids[b];
}

void BpeModel::AddMerge(int32_t left, int32_t right, uint32_t rank, int32_t new_id) {
  merges_[Key(left, right)] = Merge{rank, new_id};
}

void BpeModel::Encode(std::string_view word, BpeScratch* scratch, std::vector<int32_t>* out) const {
  if (word.size() == 1) {  // most common single-byte pieces (spaces, punctuation) skip the cache
    const int32_t id = byte_ids_[static_cast<uint8_t>(word[0])];
    if (id >= 0) {
      out->push_back(id);
    } else if (unk_id_ >= 0) {
      out->push_back(unk_id_);
    }
    return;
  }
  if (word.size() > kMaxCachedWordBytes) {
    MergeWord(word, scratch, out);
    return;
  }
  if (const auto it = scratch->cache.find(absl::string_view(word.data(), word.size())); it != scratch->cache.end()) {
    const auto* begin = scratch->cache_ids.data() + it->second.offset;
    out->insert(out->end(), begin, begin + it->second.size);
    return;
  }
  const size_t first = out->size();
  MergeWord(word, scratch, out);
  if (scratch->cache.size() >= kMaxCacheEntries) {
    scratch->cache.clear();
    scratch->cache_ids.clear();
  }
  const auto offset = static_cast<uint32_t>(scratch->cache_ids.size());
  scratch->cache_ids.insert(scratch->cache_ids.end(), out->begin() + static_cast<ptrdiff_t>(first), out->end());
  scratch->cache.emplace(std::string(word), BpeScratch::Span{offset, static_cast<uint32_t>(out->size() - first)});
}

void BpeModel::MergeWord(std::string_view word, BpeScratch* scratch, std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    if (const auto it = whole_words_.find(absl::string_view(word.data(), word.size())); it != whole_words_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  auto& syms = scratch->symbols;
  syms.clear();
  bool prev_unk = false;
  for (const char c : word) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id < 0) {
      // HF: a character missing from the vocab becomes unk (fused with a preceding unk when fuse_unk),
      // or is dropped when the model has no unk token.
      if (unk_id_ < 0) continue;
      if (fuse_unk_ && prev_unk) continue;
      prev_unk = true;
      syms.push_back({unk_id_, 0, 0, true});
      continue;
    }
    prev_unk = false;
    syms.push_back({id, 0, 0, true});
  }
  const auto n = static_cast<int32_t>(syms.size());
  for (int32_t i = 0; i < n; ++i) {
    syms[i].prev = i - 1;
    syms[i].next = i + 1 < n ? i + 1 : -1;
  }

  auto& heap = scratch->heap;
  heap.clear();
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const auto* m = FindMerge(syms[i].id, syms[i + 1].id)) {
      heap.push_back({m->rank, static_cast<uint32_t>(i), m->new_id});
    }
  }
  std::make_heap(heap.begin(), heap.end(), LowerRankFirst());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LowerRankFirst());
    const BpeScratch::Candidate top = heap.back();
    heap.pop_back();
    BpeScratch::Symbol& left = syms[top.pos];
    if (!left.live || left.next < 0) continue;
    const int32_t right_pos = left.next;
    const BpeScratch::Symbol right = syms[right_pos];
    // Stale entry: the pair at this position changed since it was queued.
    const auto* current = FindMerge(left.id, right.id);
    if (current == nullptr || current->new_id != top.new_id) continue;

    left.id = top.new_id;
    left.next = right.next;
    syms[right_pos].live = false;
    if (right.next >= 0) syms[right.next].prev = static_cast<int32_t>(top.pos);

    if (left.prev >= 0) {
      if (const auto* m = FindMerge(syms[left.prev].id, left.id)) {
        heap.push_back({m->rank, static_cast<uint32_t>(left.prev), m->new_id});
        std::push_heap(heap.begin(), heap.end(), LowerRankFirst());
      }
    }
    if (left.next >= 0) {
      if (const auto* m = FindMerge(left.id, syms[left.next].id)) {
        heap.push_back({m->rank, top.pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), LowerRankFirst());
      }
    }
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = syms[i].next) out->push_back(syms[i].id);
}

}  // namespace numoe::tokenizer
