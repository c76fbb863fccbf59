// int8 weights with a scale per row from their int8 pairs copy (kernels.cpu_gemv.pair_weight), bf16 rows on CPUs with
// AVX-512 BF16: gemv_pairs.h's tiles, converted in registers at one row, into a buffer at more.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <cstdint>

#include "pairs_converted.h"

namespace pagedserve {

#ifdef __AVX512VBMI__
// One input row x [K] against the int8 pairs' tiles (gemv_pairs' items at one row) by Int8PairsBarMin: a tile that
// holds -128 is read again by Int8Pairs, and so are the thread's later tiles of the call (a weight with -128 holds
// it in most tiles: one tile read twice per thread and call).
inline void gemv_pairs_int8_row(const uint16_t* x, const int8_t* pairs, const float* scale, const uint16_t* bias,
                                uint16_t* y, int64_t N, int64_t K) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
#pragma omp parallel
  {
    bool min_seen = false;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int8_t* tile = pairs + t * tile_elems;
      const int8_t* next = t + 1 < tiles ? tile + tile_elems : nullptr;
      if (!min_seen) {
        const Int8PairsBarMin weights(tile);
        pair_tile_of<1>(weights, x, scale + t * kPairTileRows, bias, y, t * kPairTileRows, 0, N, K, next);
        if (!(min_seen = weights.read_min())) continue;
      }
      pair_tile<1>(tile, x, scale + t * kPairTileRows, bias, y, t * kPairTileRows, 0, N, K, next);
    }
  }
}
#endif

// x [M, K] bf16, pairs: an int8 W [N, K] as pair_weight lays it out, scale [N], bias [N] or null, y [M, N]. One row
// by gemv_pairs_int8_row, more by gemv_pairs_buffered (in registers up to a group of rows, else through a buffer).
// Same products in the same order: a row's result does not depend on the row count.
inline void gemv_pairs_int8(const uint16_t* x, const int8_t* pairs, const float* scale, const uint16_t* bias,
                            uint16_t* y, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512VBMI__
  if (M == 1) return gemv_pairs_int8_row(x, pairs, scale, bias, y, N, K);
#else
  if (M == 1) return gemv_pairs(x, pairs, scale, bias, y, M, N, K);
#endif
  const int64_t tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
  gemv_pairs_buffered(x, [&](int64_t t) { return Int8Pairs(pairs + t * tile_elems); },
                      [&](int64_t t) { return pairs + t * tile_elems; }, scale, bias, y, M, N, K);
}

}  // namespace pagedserve
#endif
