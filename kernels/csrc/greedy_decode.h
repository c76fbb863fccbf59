// Greedy decode steps of a whole llama-style model in one call: embedding, layers, final norm, LM head and argmax
// for every step of a multi-step call after its first, what the Python loop computes step by step (the same
// kernels in the same order, so the same tokens) without its per-step Python and tensor dispatch.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decoder_layer.h"

namespace pagedserve {

template <typename T>
struct GreedyModel {
  std::vector<DecoderLayer<T>> layers;
  std::vector<T*> k_caches, v_caches;
  const T* final_norm;
  float final_eps;
  const T* embedding;  // [vocab rows, hidden]
  const T* head;  // [head_rows, hidden]: logits for the first `vocab` rows are compared
  int64_t head_rows, vocab;
};

// The first index of the largest value, NaN above every number: torch.argmax's choice.
template <typename T>
int64_t argmax_row(const T* v, int64_t n) {
  int64_t best = 0;
  float top = widen(v[0]);
  for (int64_t i = 1; i < n && !std::isnan(top); ++i) {
    const float x = widen(v[i]);
    if (x > top || std::isnan(x)) top = x, best = i;
  }
  return best;
}

// M rows: tokens[m], the row's last token, at positions[m]; tables [M, max_blocks]; the row takes up to limits[m]
// steps and none after a token of its stop set stop_ids[stop_starts[m], stop_starts[m + 1]). out [M, steps]: the
// row's tokens in order, -1 after its last. A step's rows are those still going, in row order.
template <typename T>
void greedy_decode(const GreedyModel<T>& model, const int64_t* tokens, const int64_t* positions,
                   const int64_t* tables, int64_t max_blocks, int64_t block_size, const int64_t* limits,
                   const int64_t* stop_ids, const int64_t* stop_starts, int64_t* out, int64_t M, int64_t steps) {
  const int64_t H = model.layers.front().hidden;
  std::fill(out, out + M * steps, int64_t(-1));
  std::vector<int64_t> last(tokens, tokens + M), taken(M, 0), rows, pos, slots, table, lens;
  std::vector<char> stopped(M, 0);
  std::vector<T> x, hidden, residual, logits;
  for (int64_t s = 0; s < steps; ++s) {
    rows.clear();
    for (int64_t m = 0; m < M; ++m)
      if (!stopped[m] && taken[m] < limits[m]) rows.push_back(m);
    const int64_t A = int64_t(rows.size());
    if (A == 0) break;
    pos.resize(A), slots.resize(A), lens.resize(A), table.resize(A * max_blocks);
    x.resize(A * H), hidden.resize(A * H), residual.resize(A * H), logits.resize(A * model.head_rows);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t m = rows[a], p = positions[m] + taken[m];
      const int64_t* row_table = tables + m * max_blocks;
      std::memcpy(x.data() + a * H, model.embedding + last[m] * H, H * sizeof(T));
      std::copy(row_table, row_table + max_blocks, table.data() + a * max_blocks);
      pos[a] = p, lens[a] = p + 1, slots[a] = row_table[p / block_size] * block_size + p % block_size;
    }
    stage_layers(model.layers, model.k_caches, model.v_caches, model.final_norm, model.final_eps, x.data(),
                 static_cast<const T*>(nullptr), hidden.data(), residual.data(), pos.data(), slots.data(), block_size,
                 table.data(), max_blocks, lens.data(), A);
    gemv(hidden.data(), model.head, static_cast<const T*>(nullptr), logits.data(), A, model.head_rows, H);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t m = rows[a], token = argmax_row(logits.data() + a * model.head_rows, model.vocab);
      out[m * steps + taken[m]] = token;
      last[m] = token, ++taken[m];
      stopped[m] = std::find(stop_ids + stop_starts[m], stop_ids + stop_starts[m + 1], token) !=
                   stop_ids + stop_starts[m + 1];
    }
  }
}

}  // namespace pagedserve
