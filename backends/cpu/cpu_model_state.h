// CpuModel's per-sequence state and step rows, shared by cpu_model.cc and dspark.cc (not a public API).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "backends/cpu/compressor.h"
#include "backends/cpu/cpu_model.h"

namespace numoe::cpu {

struct CpuModel::SeqState {
  struct Layer {
    std::vector<float> ring;  // [W, hd]: kv of position p at slot p % W
    std::unique_ptr<CompressorState> comp, index_comp;
    // Speculative step: ring slots as they were before the step wrote them (position, old kv).
    std::vector<std::pair<int64_t, std::vector<float>>> ring_undo;
  };
  int64_t position = 0;
  int64_t undo_from = -1;  // first position of the last step when it was speculative, else -1
  std::vector<Layer> layers;
  // DSpark: one kv ring [W, hd] per stage fed from the target features, with its speculative undo log.
  std::vector<std::vector<float>> drafter_rings;
  std::vector<std::vector<std::pair<int64_t, std::vector<float>>>> drafter_undo;
  // MTP: the block's kv ring [W, hd] (entry p from the target's streams at p-1 and the token at p; no entry
  // at position 0) with its speculative undo log, and the target's last-layer streams [rows, hc·D] of
  // positions [mtp_x_from, position): the last one only, or after a speculative step also the step's rows
  // and the one before them, so Rollback can restore X of the new last position.
  std::vector<float> mtp_ring;
  std::vector<std::pair<int64_t, std::vector<float>>> mtp_undo;
  std::vector<float> mtp_x;
  int64_t mtp_x_from = 0;
};

// The rows of one step: all sequences' new tokens concatenated.
struct CpuModel::Rows {
  struct Seq {
    SeqState* state;
    int64_t begin, end;  // row range
    int64_t start_pos;   // position of the first new token
  };
  std::vector<Seq> seqs;
  std::vector<int64_t> pos;
  std::vector<int32_t> token;
  std::vector<int64_t> seq;  // [n]: each row's SequenceId (MoeRequest::seqs)
  int64_t n = 0;
};

}  // namespace numoe::cpu
