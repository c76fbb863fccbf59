// A bf16 pairs product's adapter deltas added by its own threads (RowDeltas, gemv_pairs.h's hooks): the rows' shrink
// before its products, each item's deltas after it.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "lora.h"

namespace pagedserve {

// A step's adapted rows whose shrink (rows x adapter width x K) is at most this many products shrink on the calling
// thread before a product's region; more shrink inside it (RowDeltas::prepare).
constexpr int64_t kCallerShrinkProducts = 1 << 17;

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The adapted rows' deltas added by a bf16 pairs product's own threads, each to the outputs it has just computed
// (gemv_pairs's hooks): no parallel region of the adapters' own, whose fork and barriers cost more than the adapters'
// products. The rows' shrunk activations are made first, on the calling thread where they are few, else split over
// the product's threads as its region starts. Each output's delta and sum as add_lora_rows makes them.
template <typename T, typename C>
class RowDeltas {
 public:
  RowDeltas(const LoraSlots& L, const T* x, T* y, int64_t M, int64_t N, int64_t K, const int64_t* slots,
            std::vector<int64_t> rows)
      : L_(L), x_(x), y_(y), N_(N), K_(K), slots_(slots), rows_(std::move(rows)), shrunk_at_(M, -1),
        shrunk_(rows_.size() * L.width), width_blocks_((L.width + 15) / 16),
        in_region_(int64_t(rows_.size()) * L.width * K > kCallerShrinkProducts) {
    for (size_t r = 0; r < rows_.size(); ++r) shrunk_at_[rows_[r]] = int64_t(r);
    if (!in_region_)
      for (int64_t i = 0; i < int64_t(rows_.size()) * width_blocks_; ++i) shrink(i);
  }

  // On each thread of the product's region before its products: the shrink, split over them where it is large.
  void prepare() const {
    if (!in_region_) return;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < int64_t(rows_.size()) * width_blocks_; ++i) shrink(i);
  }

  // The deltas of rows m0..m0 + count_rows for outputs n0..n0 + count, added to y [M, N]: each run of adapted rows
  // of one slot over each tile of 16 outputs of a part, the tile's columns laid out once for the run.
  void after_item(int64_t n0, int64_t count, int64_t m0, int64_t count_rows) const {
    thread_local std::vector<float> tile;
    const int64_t rank = L_.width / L_.parts;
    for (int64_t m = m0; m < m0 + count_rows; ++m) {
      if (shrunk_at_[m] < 0) continue;
      const int64_t first = shrunk_at_[m];
      int64_t end = first + 1;  // rows_[first..end): adapted rows of m's slot within this item
      while (end < int64_t(rows_.size()) && rows_[end] < m0 + count_rows && slots_[rows_[end]] == slots_[m]) ++end;
      prefetch(slots_[m], n0 + count, count);
      int64_t part = 0;
      for (int64_t c0 = n0; c0 < n0 + count;) {
        while (L_.offsets && c0 >= L_.offsets[part + 1]) ++part;
        const int64_t stop = std::min(n0 + count, L_.offsets ? L_.offsets[part + 1] : N_);
        const int64_t width = std::min<int64_t>(16, stop - c0);
        const C* bt = static_cast<const C*>(L_.bt) + (slots_[m] * L_.width + part * rank) * N_ + c0;
        add_tile_deltas<T, C>(bt, N_, width, rank, shrunk_.data() + first * L_.width + part * rank, L_.width,
                              rows_.data() + first, end - first, y_ + c0, tile);
        c0 += width;
      }
      m = rows_[end - 1];
    }
  }

 private:
  void shrink(int64_t i) const { shrink_item(L_, x_, rows_.data(), i, K_, slots_, shrunk_.data()); }

  // Slot s's bt columns of the item after this one (`width` outputs from `from`: gemv_pairs hands each thread
  // consecutive tiles of one width), while this item's products run: each of the rank rows it reads lies a row of N
  // outputs from the next, a stride the hardware prefetchers do not follow, and the adapters' rows leave the caches
  // as the layers' weights stream through.
  void prefetch(int64_t s, int64_t from, int64_t width) const {
    if (from >= N_) return;
    int64_t part = 0;
    while (L_.offsets && from >= L_.offsets[part + 1]) ++part;
    const int64_t rank = L_.width / L_.parts;
    const C* bt = static_cast<const C*>(L_.bt) + (s * L_.width + part * rank) * N_ + from;
    const int64_t last = std::min(width, N_ - from) - 1;
    for (int64_t j = 0; j < rank; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(bt + j * N_), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(bt + j * N_ + last), _MM_HINT_T0);
    }
  }

  const LoraSlots& L_;
  const T* x_;
  T* y_;
  int64_t N_, K_;
  const int64_t* slots_;
  std::vector<int64_t> rows_;  // the adapted rows, ascending
  std::vector<int64_t> shrunk_at_;  // each row's index in rows_ (its shrunk activations'), -1: not adapted
  mutable std::vector<C> shrunk_;  // written by the shrink (prepare() is const: gemv_pairs holds its hooks so)
  int64_t width_blocks_;
  bool in_region_;
};
#endif

}  // namespace pagedserve
