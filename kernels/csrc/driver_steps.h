// A multi-step call over several ranks where only the driver can choose: with drafts (the driver alone holds the
// speculator, a draft model and its drafts' distributions) or over pipeline stages (the last stage alone has the
// logits), the driver drafts and chooses each step's tokens, and its drafts, then its tokens, reach every other rank
// through shared memory, which feed and take the same.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "tp_reduce.h"

namespace pagedserve {

// The ranks that follow the driver's choices (a TP group's, or every pipeline rank's), or none where each rank
// chooses alike (one rank, or a TP group's argmax and draws over logits gathered whole on every rank).
struct StepFollowers {
  const ShmGroup* group = nullptr;
  int64_t driver = 0;

  bool leads() const { return !group || group->rank == driver; }
};

// Each of the step's A rows' drafts to feed (feeds [A], drafts [A, k]), the driver's on every rank.
inline void share_drafts(const StepFollowers& f, int64_t k, std::vector<int64_t>& feeds, std::vector<int64_t>& drafts,
                         std::vector<int64_t>& packed) {
  const int64_t A = int64_t(feeds.size());
  packed.assign(feeds.begin(), feeds.end());
  packed.insert(packed.end(), drafts.begin(), drafts.begin() + A * k);
  broadcast(*f.group, packed.data(), int64_t(packed.size()), f.driver);
  std::copy(packed.begin(), packed.begin() + A, feeds.begin());
  std::copy(packed.begin() + A, packed.end(), drafts.begin());
}

// What the driver's step gave each of the rows seqs (out's columns of row m from before[a]: its tokens, -2 where its
// sampling failed, then -1), `width` columns each, from the driver to every rank; the others' rows of out are
// theirs to fill from it (packed [A, width]).
inline void share_taken(const StepFollowers& f, const std::vector<int64_t>& seqs, const std::vector<int64_t>& before,
                        int64_t width, const int64_t* out, int64_t out_cols, std::vector<int64_t>& packed) {
  const int64_t A = int64_t(seqs.size());
  packed.assign(A * width, -1);
  if (f.leads())
    for (int64_t a = 0; a < A; ++a) {
      const int64_t* row = out + seqs[a] * out_cols + before[a];
      std::copy(row, row + std::min(width, out_cols - before[a]), packed.data() + a * width);
    }
  broadcast(*f.group, packed.data(), A * width, f.driver);
}

}  // namespace pagedserve
