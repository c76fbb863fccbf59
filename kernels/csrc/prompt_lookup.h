// Prompt lookup's drafts for the C++ steps (greedy_decode.h), as workers/spec_decode/ngram.py proposes them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedserve {

// Prompt lookup as workers/spec_decode/ngram.py proposes: up to k tokens, into drafts, that followed the latest
// earlier occurrence of the longest suffix of `tokens` between min_n and max_n long; how many (0: no such suffix).
inline int64_t lookup_drafts(const std::vector<int64_t>& tokens, int64_t k, int64_t min_n, int64_t max_n,
                             int64_t* drafts) {
  const int64_t L = int64_t(tokens.size());
  for (int64_t n = std::min(max_n, L - 1); n >= std::max<int64_t>(min_n, 1); --n) {
    const int64_t* suffix = tokens.data() + L - n;
    for (int64_t at = L - 1 - n; at >= 0; --at)  // an occurrence ends before the last token
      if (std::equal(suffix, suffix + n, tokens.data() + at)) {
        const int64_t count = std::min(k, L - (at + n));
        std::copy(tokens.data() + at + n, tokens.data() + at + n + count, drafts);
        return count;
      }
  }
  return 0;
}

// Drafts verified in the greedy steps (k = 0: none): each row's tokens so far (its last token's included) are
// history[history_starts[m], history_starts[m + 1]); verified [M, steps, 2] gets each step's drafted and accepted
// counts (-1 where the row verified no draft).
struct PromptLookup {
  int64_t k = 0, min_n = 1, max_n = 0;
  const int64_t* history = nullptr;
  const int64_t* history_starts = nullptr;
  int64_t* verified = nullptr;
};

}  // namespace pagedserve
