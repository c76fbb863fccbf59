// The decode attention's scores on AMX: a block's bf16 K rows (tile A) times up to 16 queries' dims in pairs (B).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "common.h"

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
// Scores of one (run, KV head) item's queries against K rows in pieces of 16 rows, each query group's tile products of
// kPieces pieces at a time: a product's latency is several times its issue interval, so one piece's chain alone
// leaves the tile unit idle. Tiles 0-3: the float32 sums [16 K rows x Q queries] of each piece; 4 and 6: 16 K rows'
// 32 dims; 5: the Q queries' same 32 dims as pairs (the layout tdpbf16ps takes for B). Each sum runs over the dims in
// the order of their 32-dim chunks, whichever queries or rows share the tile, so a query's scores do not depend on
// its neighbours.
class AmxScores {
 public:
  static constexpr int kPieces = 4;
  explicit AmxScores(int64_t dim) : dim_(dim) {}
  ~AmxScores() {
    if (configured_) _tile_release();
  }

  // The item's `count` queries (query j's dims at query(j)): groups of Q = min(count, 16), the last one's missing
  // queries zeros; query j's scores go to out + j * stride + the rows' column, times scale.
  template <typename QueryOf>
  void set_queries(int64_t count, QueryOf query, float* out, int64_t stride, float scale) {
    const int64_t width = std::min<int64_t>(count, 16), chunk = 16 * width;
    if (width != queries_) configure(width);
    count_ = count, out_ = out, stride_ = stride, scale_ = scale, used_ = 0, pieces_ = 0;
    pairs_.assign((count + width - 1) / width * (dim_ / 32) * chunk, 0);
    for (int64_t j = 0; j < count; ++j) {
      const uint32_t* q = reinterpret_cast<const uint32_t*>(query(j));
      uint32_t* group = pairs_.data() + (j / width) * (dim_ / 32) * chunk + j % width;
      for (int64_t p = 0; p < dim_ / 2; ++p) group[(p / 16) * chunk + (p % 16) * width] = q[p];
    }
  }

  // Room for `count` rows (rounded up to 16) that stay put until their scores are taken (an fp8 block's bf16 rows):
  // the room is reused only after a flush, which takes every pending piece's scores.
  uint16_t* stage(int64_t count) {
    const int64_t rows = (count + 15) / 16 * 16;
    if (used_ + rows > int64_t(stage_.size()) / dim_) flush(), used_ = 0;
    // Made on first use (a partial block's rows, an fp8 block's bf16 copy), after a flush: no pending piece reads it.
    if (rows * dim_ > int64_t(stage_.size())) stage_.resize(std::max<int64_t>(rows, kPieces * 16) * dim_);
    used_ += rows;
    return stage_.data() + (used_ - rows) * dim_;
  }

  // The scores of `count` consecutive bf16 rows k_i (dim apart) at columns [column, column + count); rows taken from
  // stage() are read in place, others in place where 16 follow, else copied (rows past a short block's end may lie
  // past the cache).
  void add(const uint16_t* k, int64_t count, int64_t column) {
    const bool staged = k >= stage_.data() && k < stage_.data() + stage_.size();
    for (int64_t i = 0; i < count; i += 16) {
      const int64_t n = std::min<int64_t>(16, count - i);
      const uint16_t* a = k + i * dim_;
      if (n < 16 && !staged) {
        uint16_t* copy = stage(n);
        std::memcpy(copy, a, n * dim_ * sizeof(uint16_t));
        a = copy;
      }
      pending_[pieces_++] = Piece{a, n, column + i};
      if (pieces_ == kPieces) flush();
    }
  }

  // The pending pieces' scores written out.
  void flush() {
    if (pieces_ > 0) {
      for (int64_t first = 0; first < count_; first += queries_) products(first);
    }
    pieces_ = 0;
  }

 private:
  struct Piece {
    const uint16_t* rows;
    int64_t count, column;
  };

  void products(int64_t first) {
    const uint32_t* group = pairs_.data() + first / queries_ * (dim_ / 32) * 16 * queries_;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < dim_ / 32; ++c) {
      _tile_loadd(5, group + c * 16 * queries_, queries_ * 4);
      // GCC's tile intrinsics take the tile numbers as literal text: one line each.
      const uint16_t* const at[kPieces] = {pending_[0].rows + c * 32, pending_[1].rows + c * 32,
                                           pending_[2].rows + c * 32, pending_[3].rows + c * 32};
      const int64_t stride = dim_ * sizeof(uint16_t);
      _tile_loadd(4, at[0], stride);
      _tile_dpbf16ps(0, 4, 5);
      if (pieces_ > 1) _tile_loadd(6, at[1], stride);
      if (pieces_ > 1) _tile_dpbf16ps(1, 6, 5);
      if (pieces_ > 2) _tile_loadd(4, at[2], stride);
      if (pieces_ > 2) _tile_dpbf16ps(2, 4, 5);
      if (pieces_ > 3) _tile_loadd(6, at[3], stride);
      if (pieces_ > 3) _tile_dpbf16ps(3, 6, 5);
    }
    _tile_stored(0, sums_[0], 64);
    _tile_stored(1, sums_[1], 64);
    _tile_stored(2, sums_[2], 64);
    _tile_stored(3, sums_[3], 64);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    const __m512 scale = _mm512_set1_ps(scale_);
    for (int p = 0; p < pieces_; ++p) {
      const __mmask16 valid = __mmask16((1u << pending_[p].count) - 1);
      for (int64_t j = 0; j < std::min(queries_, count_ - first); ++j) {
        const __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32(int(j)));
        const __m512 s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, at, sums_[p], 4);
        _mm512_mask_storeu_ps(out_ + (first + j) * stride_ + pending_[p].column, valid, _mm512_mul_ps(s, scale));
      }
    }
  }

  void configure(int64_t queries) {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1; then 16 two-byte column widths, then 16 row counts
    const uint16_t sums = uint16_t(queries * 4);
    const uint16_t widths[8] = {sums, sums, sums, sums, 64, sums, 64, 0};
    std::memcpy(config + 16, widths, sizeof(widths));
    for (int t = 0; t < 7; ++t) config[48 + t] = 16;
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: the rest of the stores must not be dropped.
    __asm__ __volatile__("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
    queries_ = queries, configured_ = true;
  }

  int64_t dim_, queries_ = 0, count_ = 0, stride_ = 0, used_ = 0;
  int pieces_ = 0;
  bool configured_ = false;
  float* out_ = nullptr;
  float scale_ = 1.f;
  std::vector<uint16_t> stage_;
  std::vector<uint32_t> pairs_;
  Piece pending_[kPieces] = {};
  alignas(64) float sums_[kPieces][16 * 16];
};
#else
class AmxScores {
 public:
  explicit AmxScores(int64_t) {}
  template <typename QueryOf>
  void set_queries(int64_t, QueryOf, float*, int64_t, float) {}
  uint16_t* stage(int64_t) { return nullptr; }
  void add(const uint16_t*, int64_t, int64_t) {}
  void flush() {}
};
#endif

}  // namespace pagedserve
