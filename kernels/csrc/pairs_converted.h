// gemv_pairs.h's products from weights stored in another type (int8, fp8, 4-bit): each tile's column pairs converted
// to bf16 by the type's pairs functor, in registers for a group of rows or fewer, else once into a buffer.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <algorithm>
#include <cstdint>
#include <vector>

#include "gemv_pairs.h"

namespace pagedserve {

// Each tile converted to bf16 once (tile_of(t): tile t's pairs functor, as pairs_of gives it) into a buffer, which
// rows(t, buffer) then reads as a bf16 tile; threads split the tiles.
template <typename TileOf, typename Rows>
void each_tile_converted(TileOf tile_of, int64_t N, int64_t K, Rows rows) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, steps = (K + 1) / 2;
#pragma omp parallel
  {
    std::vector<uint16_t> converted(steps * 2 * kPairTileRows);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const auto weights = tile_of(t);
      for (int64_t p = 0; p < steps; ++p) {
        __m512bh w0, w1;
        weights(p, w0, w1);
        _mm512_storeu_si512(converted.data() + p * 64, (__m512i)w0);
        _mm512_storeu_si512(converted.data() + p * 64 + 32, (__m512i)w1);
      }
      rows(t, converted.data());
    }
  }
}

// x [M, K] bf16 against tiles converted to bf16 (tile_of(t): tile t's pairs functor): up to a group of input rows
// convert each tile in registers; more convert it once into a buffer that their groups then read as a bf16 tile, the
// first group prefetching the next tile's stored bytes (next_of(t): tile t's, one 64-byte line a column pair; or null).
// scale [N] (each sum's) or null, bias [N] or null, y [M, N]. Threads split the tiles.
template <typename TileOf, typename NextOf>
void gemv_pairs_buffered(const uint16_t* x, TileOf tile_of, NextOf next_of, const float* scale, const uint16_t* bias,
                         uint16_t* y, int64_t M, int64_t N, int64_t K) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows;
  if (M <= kPairGroupRows) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      pair_group_of(tile_of(t), x, bias, y, t * kPairTileRows, 0, M, N, K, scale ? scale + t * kPairTileRows : nullptr,
                    t + 1 < tiles ? next_of(t + 1) : nullptr);
    return;
  }
  each_tile_converted(tile_of, N, K, [&](int64_t t, const uint16_t* converted) {
    for (int64_t m0 = 0; m0 < M; m0 += kPairGroupRows)
      pair_group_of(Bf16Pairs{converted}, x, bias, y, t * kPairTileRows, m0, std::min(kPairGroupRows, M - m0), N, K,
                    scale ? scale + t * kPairTileRows : nullptr, m0 == 0 && t + 1 < tiles ? next_of(t + 1) : nullptr);
  });
}

}  // namespace pagedserve
#endif
