// y = x W^T + b for bf16 x and W on CPUs with AVX-512 BF16, from W repacked once into "pairs" tiles: 32 output
// rows at a time, column pairs outermost, so that one 512-bit load holds one column pair of 16 output rows. Each
// input row's pair is broadcast and vdpbf16ps adds both products into those 16 rows' float32 sums: no sum is ever
// added across lanes, each weight tile streams from memory once per call and stays in L1 while groups of 8 input
// rows pass over it. Every output's sum runs over the column pairs in order in one lane, whatever the row count,
// tiling or threads, so a row's result does not depend on the rows beside it. One rounding to bf16.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "common.h"

namespace pagedserve {

// Output rows per tile, and input rows per pass over a tile (2 x 8 sums in registers).
constexpr int64_t kPairTileRows = 32, kPairGroupRows = 8;

// Input rows m0..m0+MB against the tile of output rows n0..n0+32 (tile: [K / 2 pairs][32 rows][2], zero past N
// and K).
template <int MB>
inline void pair_tile(const uint16_t* tile, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                      int64_t m0, int64_t N, int64_t K) {
  __m512 a[MB][2];
  for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  auto step = [&](int64_t p, auto pair_of) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + p * 64);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + p * 64 + 32);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair_of(x + (m0 + m) * K + 2 * p));
      a[m][0] = _mm512_dpbf16_ps(a[m][0], w0, xv);
      a[m][1] = _mm512_dpbf16_ps(a[m][1], w1, xv);
    }
  };
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p)
    step(p, [](const uint16_t* at) { int32_t v; std::memcpy(&v, at, 4); return v; });
  if (K % 2)  // the last column alone: its pair's other half is zero (never read past the row)
    step(pairs, [](const uint16_t* at) { return int32_t(*at); });
  const int64_t count = std::min<int64_t>(32, N - n0);
  alignas(64) float b[32] = {};
  for (int64_t i = 0; bias && i < count; ++i) b[i] = widen(bias[n0 + i]);
  for (int m = 0; m < MB; ++m) {
    // A whole tile's outputs go straight to y; a last, partial one's through a buffer (a memcpy call per row and
    // tile was ~9% of the samples of 8-row demo decode steps).
    alignas(64) uint16_t out[32];
    uint16_t* to = count == 32 ? y + (m0 + m) * N + n0 : out;
    for (int h = 0; h < 2; ++h) {
      const __m512 sums = _mm512_add_ps(a[m][h], _mm512_load_ps(b + 16 * h));
      store8(_mm512_castps512_ps256(sums), to + 16 * h);  // common.h's rounding, 8 lanes at a time
      store8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)), to + 16 * h + 8);
    }
    if (count < 32) std::memcpy(y + (m0 + m) * N + n0, out, count * sizeof(uint16_t));
  }
}

// Input rows m0..m0+MB (at most 8) against one tile.
inline void pair_group(const uint16_t* tile, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                       int64_t m0, int64_t MB, int64_t N, int64_t K) {
  switch (MB) {
    case 8: pair_tile<8>(tile, x, bias, y, n0, m0, N, K); break;
    case 7: pair_tile<7>(tile, x, bias, y, n0, m0, N, K); break;
    case 6: pair_tile<6>(tile, x, bias, y, n0, m0, N, K); break;
    case 5: pair_tile<5>(tile, x, bias, y, n0, m0, N, K); break;
    case 4: pair_tile<4>(tile, x, bias, y, n0, m0, N, K); break;
    case 3: pair_tile<3>(tile, x, bias, y, n0, m0, N, K); break;
    case 2: pair_tile<2>(tile, x, bias, y, n0, m0, N, K); break;
    default: pair_tile<1>(tile, x, bias, y, n0, m0, N, K); break;
  }
}

// x [M, K], pairs: W [N, K] as [ceil(N / 32)][ceil(K / 2)][32][2] (kernels/cpu_gemv.py's pair_weight), bias [N] or
// null, y [M, N]. Threads split (tile, group of 8 input rows) items, consecutive groups of a tile to one thread.
inline void gemv_pairs_bf16(const uint16_t* x, const uint16_t* pairs, const uint16_t* bias, uint16_t* y, int64_t M,
                            int64_t N, int64_t K) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, groups = (M + kPairGroupRows - 1) / kPairGroupRows;
  const int64_t tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < tiles * groups; ++item) {
    const int64_t t = item / groups, m0 = item % groups * kPairGroupRows;
    pair_group(pairs + t * tile_elems, x, bias, y, t * kPairTileRows, m0, std::min(kPairGroupRows, M - m0), N, K);
  }
}

// One of gemv_pairs_together's products: y [M, N] = x W^T + b from W's pairs copy, bias [N] or null.
struct PairsProduct {
  const uint16_t* pairs;
  const uint16_t* bias;
  uint16_t* y;
  int64_t N;
};

// gemv_pairs_bf16 of each product of the same x [M, K] (at most 4), all their items in one parallel region: one
// barrier for all, each output as gemv_pairs_bf16 computes it.
inline void gemv_pairs_together(const uint16_t* x, std::initializer_list<PairsProduct> products, int64_t M,
                                int64_t K) {
  const int64_t groups = (M + kPairGroupRows - 1) / kPairGroupRows, tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
  const PairsProduct* each = products.begin();
  const int64_t count = int64_t(products.size());
  int64_t first[5] = {0};  // each product's first item
  for (int64_t i = 0; i < count; ++i)
    first[i + 1] = first[i] + (each[i].N + kPairTileRows - 1) / kPairTileRows * groups;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < first[count]; ++item) {
    int64_t i = 0;
    while (item >= first[i + 1]) ++i;
    const PairsProduct& p = each[i];
    const int64_t t = (item - first[i]) / groups, m0 = (item - first[i]) % groups * kPairGroupRows;
    pair_group(p.pairs + t * tile_elems, x, p.bias, p.y, t * kPairTileRows, m0, std::min(kPairGroupRows, M - m0), p.N,
               K);
  }
}

}  // namespace pagedserve
#endif
