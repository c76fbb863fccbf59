// The logprobs a row reports for a token of a multi-step call: of the model's own distribution (log_softmax of its
// scores, before penalties, bias and temperature: workers/layers/sampler.py's raw_logprobs), the token's, its rank
// and the row's best tokens.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace pagedserve {

// Rows that report logprobs (null num: none): num[m] >= 0 where row m does, how many best tokens it reports beside
// its own. For its i-th token of the call (slot m * columns + i): ids[slot * width + j] and values[slot * width + j]
// are the token (j = 0), then its num[m] best (fewer with a smaller vocabulary; -1 after them), and ranks[slot] the
// token's rank (1 = best).
struct RowLogprobs {
  const int64_t* num = nullptr;
  int64_t width = 0;
  int64_t* ids = nullptr;
  float* values = nullptr;
  int64_t* ranks = nullptr;

  bool reports(int64_t m) const { return num != nullptr && num[m] >= 0; }
};

// out = log_softmax(scores) of one row (out not scores): (score - max) - log(sum of e^(score - max)), torch's
// order of operations; the sampler's own logprobs on the CPU come from here too, so both paths give the same bits.
inline void log_softmax_row(const float* scores, int64_t vocab, float* out) {
  const float max = max_of(scores, vocab);
  std::copy(scores, scores + vocab, out);
  const float log_sum = std::log(exp_sum(out, vocab, max));
  for (int64_t v = 0; v < vocab; ++v) out[v] = (scores[v] - max) - log_sum;
}

// Row m's logprobs of `token` into its slot, from its scores (vocab of them); logprobs: room for vocab floats. The
// rank counts the logprobs above the token's and the best are taken by logprob, ties to the lower id, as the
// sampler's gather_logprobs (workers/layers/logprobs.py) does.
inline void report_logprobs(const RowLogprobs& out, int64_t m, int64_t slot, int64_t token, const float* scores,
                            int64_t vocab, float* logprobs) {
  log_softmax_row(scores, vocab, logprobs);
  const float chosen = logprobs[token];
  int64_t above = 0;
  for (int64_t v = 0; v < vocab; ++v) above += logprobs[v] > chosen;
  out.ranks[slot] = above + 1;
  int64_t* ids = out.ids + slot * out.width;
  float* values = out.values + slot * out.width;
  std::fill(ids, ids + out.width, int64_t(-1));
  ids[0] = token, values[0] = chosen;
  // The n best kept in order in ids[1..]: most logprobs cost one comparison.
  const int64_t n = std::min(out.num[m], vocab);
  int64_t* best = ids + 1;
  int64_t kept = 0;
  for (int64_t v = 0; v < vocab && n > 0; ++v) {
    if (kept == n && !(logprobs[v] > logprobs[best[n - 1]])) continue;
    int64_t j = kept < n ? kept++ : n - 1;
    for (; j > 0 && logprobs[v] > logprobs[best[j - 1]]; --j) best[j] = best[j - 1];
    best[j] = v;
  }
  for (int64_t j = 0; j < kept; ++j) values[j + 1] = logprobs[best[j]];
}

}  // namespace pagedserve
