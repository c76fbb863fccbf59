// gemv_pairs.h's products on AMX: a pairs tile's column pairs are already the layout tdpbf16ps takes for B (16
// pairs of 16 output rows, 128 bytes apart), so a block of up to 16 input rows (A) times both halves of the tile's
// 32 output rows is two tile products per 32 columns. Each output's sum runs over the columns in the order of their
// 32-column chunks, whichever rows share the block, so a row's result does not depend on the rows beside it; the sums
// differ from vdpbf16ps's in their last bits, so a caller takes one path or the other for a whole model.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx.h"
#include "common.h"
#include "gemv_pairs.h"

namespace pagedserve {

#ifdef PAGEDSERVE_AMX
// One thread's tiles for pairs products. Tiles 0 and 1: the block's float32 sums over output rows 0-15 and 16-31 of
// a pairs tile; 2 and 3: those rows' 16 column pairs; 4: the block's 32 columns.
class AmxPairs {
 public:
  AmxPairs() = default;
  AmxPairs(const AmxPairs&) = delete;
  AmxPairs& operator=(const AmxPairs&) = delete;
  ~AmxPairs() {
    if (rows_) _tile_release();
  }

  // y rows m0..m0+count (count <= 16) at output rows n0..n0+32 of y [M, N] = x [M, K] W^T, from the pairs tile
  // `tile` of W (gemv_pairs.h's layout, zero past N and K), rounded once. next: a tile of the same size read after
  // this one, or null: its lines are prefetched into L2 as this one's stream in.
  void tile(const uint16_t* tile, const uint16_t* x, uint16_t* y, int64_t n0, int64_t m0, int64_t count, int64_t N,
            int64_t K, const uint16_t* next) {
    if (count != rows_) configure(count);
    const int64_t chunks = K / 32, rest = K % 32, pair_rows = 16 * 64;  // a chunk's 16 pairs: 16 x 64 elements
    const uint16_t* a = x + m0 * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; ++c) {
      if (next) prefetch_lines(next + c * pair_rows, 16 * 128);
      _tile_loadd(4, a + c * 32, K * sizeof(uint16_t));
      _tile_loadd(2, tile + c * pair_rows, 128);
      _tile_loadd(3, tile + c * pair_rows + 32, 128);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
    if (rest) {  // the last columns, both operands zero past K: x's rows end there, and the tile does before 16 pairs
      const int64_t pairs = (rest + 1) / 2;
      std::memset(a_rest_, 0, sizeof(a_rest_));
      std::memset(b_rest_, 0, sizeof(b_rest_));
      for (int64_t m = 0; m < count; ++m) std::memcpy(a_rest_ + m * 32, a + m * K + chunks * 32, rest * 2);
      std::memcpy(b_rest_, tile + chunks * pair_rows, pairs * 64 * sizeof(uint16_t));
      if (next) prefetch_lines(next + chunks * pair_rows, pairs * 128);
      _tile_loadd(4, a_rest_, 64);
      _tile_loadd(2, b_rest_, 128);
      _tile_loadd(3, b_rest_ + 32, 128);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
    _tile_stored(0, sums_, 128);
    _tile_stored(1, sums_[0] + 16, 128);
    alignas(64) static constexpr float kNoBias[32] = {};
    for (int64_t m = 0; m < count; ++m) {
      const __m512 row[2] = {_mm512_load_ps(sums_[m]), _mm512_load_ps(sums_[m] + 16)};
      store_row_sums(row, nullptr, kNoBias, y + (m0 + m) * N + n0, std::min<int64_t>(32, N - n0));
    }
  }

 private:
  static void prefetch_lines(const uint16_t* from, int64_t bytes) {
    const char* line = reinterpret_cast<const char*>(from);
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(line + at, _MM_HINT_T1);
  }

  void configure(int64_t rows) {
    alignas(64) uint8_t config[64] = {};
    config[0] = 1;  // palette 1; then 16 two-byte row widths in bytes, then 16 row counts (unused tiles: 0, 0)
    const uint16_t widths[5] = {64, 64, 64, 64, 64};
    std::memcpy(config + 16, widths, sizeof(widths));
    const uint8_t counts[5] = {uint8_t(rows), uint8_t(rows), 16, 16, uint8_t(rows)};
    std::memcpy(config + 48, counts, sizeof(counts));
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes: the rest of the stores must not be dropped.
    __asm__ __volatile__("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
    rows_ = rows;
  }

  int64_t rows_ = 0;
  alignas(64) float sums_[16][32];
  alignas(64) uint16_t a_rest_[16 * 32];
  alignas(64) uint16_t b_rest_[16 * 64];
};
#endif

}  // namespace pagedserve
