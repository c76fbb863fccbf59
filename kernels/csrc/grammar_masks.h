// Rows whose tokens a grammar restricts in greedy_decode's steps: before each step the host's matchers
// (before_step) fill each constrained row's mask and halt the rows whose grammar ended; a masked row's scores get
// -inf at every token its mask leaves out, before its bias, penalties and draw (the sampler's order).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>

namespace pagedserve {

// bits [M, words]: bit j of word w allows token 32 * w + j of row m where constrained[m]; halted [M]: rows that take
// no more steps (written by before_step). Null bits: no row is constrained.
struct RowMasks {
  const int32_t* bits = nullptr;
  int64_t words = 0;
  const uint8_t* constrained = nullptr;
  const uint8_t* halted = nullptr;
  std::function<void()> before_step;
};

inline bool masks(const RowMasks& grammar, int64_t m) { return grammar.bits && grammar.constrained[m]; }

inline bool halted(const RowMasks& grammar, int64_t m) { return grammar.bits && grammar.halted[m]; }

// -inf at each of the row's first `vocab` scores its mask leaves out (tokens past its words too).
inline void mask_row(const RowMasks& grammar, int64_t m, float* scores, int64_t vocab) {
  const uint32_t* row = reinterpret_cast<const uint32_t*>(grammar.bits + m * grammar.words);
  const int64_t covered = std::min(vocab, grammar.words * 32);
  for (int64_t v = 0; v < covered; ++v)
    if (!((row[v >> 5] >> (v & 31)) & 1u)) scores[v] = -INFINITY;
  for (int64_t v = covered; v < vocab; ++v) scores[v] = -INFINITY;
}

}  // namespace pagedserve
