// A draft model's drafts inside the C++ steps (greedy_decode.h): the target's steps verify what it writes.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "greedy_model.h"
#include "mtp_drafts.h"

namespace pagedserve {

// Drafts from a smaller model with the same vocabulary instead of prompt lookup (null model: lookup). known[m]: how
// many positions of row m its K/V caches were fed, updated in place; those below the row's last token's position
// hold its tokens (drafts fed past its last accepted one are fed again from its last token on). With next [M, k]:
// after the last step, the k drafts of each unconstrained row that goes on and has k slots from its last token on
// (capacity[m]: the positions its blocks and the model length give), the others' -1: what the next call's first
// step verifies; a sampled row's the distributions they were drawn from in next_q [M, k, target's vocab].
// With mtp the model is DeepSeek-V3's multi-token-prediction layer (mtp_drafts.h), which drafts from the target's
// hidden states: a row drafts where it has a seed, and nothing is written to next.
template <typename T>
struct DraftModel {
  const GreedyModel<T>* model = nullptr;
  int64_t* known = nullptr;
  const int64_t* capacity = nullptr;
  int64_t* next = nullptr;
  float* next_q = nullptr;
  const MtpLayer<T>* mtp = nullptr;
};

// A draft round of at most this many token rows runs on one thread: a draft model's products are too small to pay
// for waking the others (the demo's draft at batch 1, 2-core EPYC: 0.5x -> 0.66x of plain decoding's speed).
constexpr int64_t kDraftOneThreadRows = 8;

// want[a] drafts for each row a of seqs, into drafts[a * k ..]: the draft model first takes the tokens its K/V lacks
// (history[m] from known[m] on, the last one's included: its logits give the first draft), then the token
// pick(a, j, logits) chooses from its logits for row a's j-th draft, one token at a time, every row of a round in
// one pass. known[m] then counts every position fed (the last draft is not).
template <typename T, typename Pick>
void model_drafts(const DraftModel<T>& draft, const std::vector<std::vector<int64_t>>& history,
                  const std::vector<int64_t>& seqs, const std::vector<int64_t>& want, int64_t k,
                  const int64_t* tables, int64_t max_blocks, int64_t block_size, int64_t* drafts, Pick&& pick) {
  const GreedyModel<T>& d = *draft.model;
  const int64_t H = d.layers.front().hidden, A = int64_t(seqs.size());
  std::vector<int64_t> pos, slots, lens, table, owners, fed;
  std::vector<T> x, hidden, residual, last, logits;
  for (int64_t a = 0; a < A; ++a)  // at least the last token is fed: its logits give the first draft
    draft.known[seqs[a]] = std::min(draft.known[seqs[a]], int64_t(history[seqs[a]].size()) - 1);
  for (int64_t j = 0;; ++j) {
    pos.clear(), slots.clear(), lens.clear(), table.clear(), owners.clear(), fed.clear(), last.clear();
    for (int64_t a = 0; a < A; ++a) {
      if (want[a] <= j) continue;
      const int64_t m = seqs[a], L = int64_t(history[m].size());
      const int64_t* row_table = tables + m * max_blocks;
      for (int64_t p = j ? L - 1 + j : draft.known[m]; p <= L - 1 + j; ++p) {
        fed.push_back(p < L ? history[m][p] : drafts[a * k + p - L]);
        table.insert(table.end(), row_table, row_table + max_blocks);
        pos.push_back(p), lens.push_back(p + 1);
        slots.push_back(row_table[p / block_size] * block_size + p % block_size);
      }
      owners.push_back(a);
    }
    const int64_t R = int64_t(pos.size()), n = int64_t(owners.size());
    if (n == 0) break;
    x.resize(R * H);
    embed(d, fed.data(), pos.data(), R, H, x.data());
    hidden.resize(R * H), residual.resize(R * H), last.resize(n * H), logits.resize(n * d.head_rows);
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    if (R <= kDraftOneThreadRows) omp_set_num_threads(1);
#endif
    stage_layers(d.layers, d.caches, d.final_norm, x.data(), static_cast<const T*>(nullptr),
                 hidden.data(), residual.data(), pos.data(), slots.data(), block_size, table.data(), max_blocks,
                 lens.data(), R);
    for (int64_t i = 0, r = 0; i < n; ++i) {  // each row's last fed token: the row ends where the next one starts
      const int64_t a = owners[i], m = seqs[a];
      r += j ? 1 : int64_t(history[m].size()) - draft.known[m];
      std::copy(hidden.data() + (r - 1) * H, hidden.data() + r * H, last.data() + i * H);
    }
    products(last.data(), d.head, d.head_pairs, static_cast<const T*>(nullptr), logits.data(), n, d.head_rows, H);
    for (int64_t i = 0; i < n; ++i) drafts[owners[i] * k + j] = pick(owners[i], j, logits.data() + i * d.head_rows);
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
  }
  for (int64_t a = 0; a < A; ++a)
    if (want[a] > 0) draft.known[seqs[a]] = int64_t(history[seqs[a]].size()) + want[a] - 1;
}

}  // namespace pagedserve
