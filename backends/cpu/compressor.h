// KV compression state of one layer of one sequence (docs/dsv4-architecture.md §2.7-2.8).
//
// Tokens are appended in position order with their projected kv and gate rows ([coff·dim] each). Every
// `rate` tokens a window closes and exactly one entry [dim] is emitted: a per-channel softmax over the
// window's slots (gate + ape) weights the kv rows; the pooled vector is RMS-normalised with `norm` and
// roped at the window's first position. With `overlap` (CSA and the indexer, coff = 2) each entry pools
// 2·rate slots: the first half (Ca) of the PREVIOUS window's tokens and the second half (Cb) of this
// window's tokens; the first window's Ca slots are empty (weight 0).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace numoe::cpu {

// Rows of fixed width stored in fixed-size blocks: appending never moves existing rows.
class ChunkedRows {
 public:
  explicit ChunkedRows(int64_t width, int64_t rows_per_block = 64) : width_(width), per_block_(rows_per_block) {}
  // Deep copies of the rows held (a forked sequence's entries).
  ChunkedRows(const ChunkedRows& other);
  ChunkedRows& operator=(const ChunkedRows& other);
  ChunkedRows(ChunkedRows&&) = default;
  ChunkedRows& operator=(ChunkedRows&&) = default;
  float* Append();  // returns the new row (uninitialised)
  void Truncate(int64_t rows);  // drops rows past `rows` (blocks are kept for reuse)
  const float* Row(int64_t i) const { return blocks_[i / per_block_].get() + (i % per_block_) * width_; }
  int64_t rows() const { return rows_; }
  int64_t width() const { return width_; }
  int64_t capacity_bytes() const {
    return static_cast<int64_t>(blocks_.size()) * per_block_ * width_ * static_cast<int64_t>(sizeof(float));
  }

 private:
  int64_t width_, per_block_, rows_ = 0;
  std::vector<std::unique_ptr<float[]>> blocks_;
};

struct CompressorParams {
  int64_t rate = 0;
  int64_t dim = 0;    // output entry width
  bool overlap = false;  // CSA scheme (coff = 2)
  const float* ape = nullptr;   // [rate, coff·dim]
  const float* norm = nullptr;  // [dim]
  float eps = 1e-6f;
  int64_t rope_dim = 0;
  const float* inv_freq = nullptr;  // compress rope table
  int64_t coff() const { return overlap ? 2 : 1; }
};

class CompressorState {
 public:
  explicit CompressorState(const CompressorParams& p);
  // A copy (every buffer deep-copied; the params' weight pointers are shared): ModelBackend::ForkSequence.
  CompressorState(const CompressorState&) = default;
  // Appends the token at `position` (must be exactly the next position). kv and gate are [coff·dim].
  void Append(int64_t position, const float* kv, const float* gate);

  // Speculative steps: BeginUndo() starts recording what each later Append overwrites (pending slots,
  // overlap state, emitted entries); RewindTo(p) undoes every Append at positions >= p since then, so the
  // state is exactly as if those tokens never ran. Recording stops at the next BeginUndo/EndUndo.
  void BeginUndo();
  void EndUndo();
  void RewindTo(int64_t position);
  int64_t next_position() const { return next_position_; }
  int64_t rate() const { return p_.rate; }
  const ChunkedRows& entries() const { return entries_; }
  // Host export (ModelBackend::ExportSequence): the per-sequence part (next position, pending slots, overlap
  // halves) appended to `out`; LoadFixed reads it back from [*p, end), advancing *p (false when the bytes are
  // short or do not fit these params). Entries travel by rows: entries() out, AppendEntry() in.
  void SaveFixed(std::vector<uint8_t>* out) const;
  bool LoadFixed(const uint8_t** p, const uint8_t* end);
  float* AppendEntry() { return entries_.Append(); }
  int64_t fixed_bytes() const;

 private:
  void Emit(int64_t window);
  CompressorParams p_;
  std::vector<float> pend_kv_, pend_gate_;  // [rate, coff·dim]; gate already includes ape
  std::vector<float> prev_kv_, prev_gate_;  // overlap: Ca half of the last closed window [rate, dim]
  bool has_prev_ = false;
  int64_t next_position_ = 0;
  ChunkedRows entries_;
  std::vector<float> scratch_;
  // Undo log: one record per Append since BeginUndo, in order.
  struct UndoRecord {
    int64_t position;
    std::vector<float> slot_kv, slot_gate;  // the pending slot before it was overwritten
    bool emitted = false;
    bool had_prev = false;
    std::vector<float> prev_kv, prev_gate;  // overlap state before the emission
  };
  bool recording_ = false;
  std::vector<UndoRecord> undo_;
};

}  // namespace numoe::cpu
