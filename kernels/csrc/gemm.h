// y = x W^T + b for many input rows (AVX2): outer-product register tiles over packed operands, bf16 widened once.
//
// The dot-product tiles of gemv.h load an input vector and a weight vector for every few FMAs, which caps them
// near 40% of the FMA peak once a step has more than a few rows. Here the input rows are packed k-major in
// blocks of 16 ([K][16] float32, two vectors per k) and a tile of 6 weight rows is widened to float32 once per pass
// of up to 128 rows; each k then costs two vector loads and six broadcasts for twelve FMAs into 6 x 16 accumulators
// that stay in registers over 512 columns at a time. Sums run over k in order, in float32, rounded once to the output
// dtype.
#pragma once
#ifdef __AVX2__
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "fp8.h"

namespace pagedserve {

constexpr int64_t kGemmMinRows = 12;  // fewer rows: gemv.h's dot products (memory-bound there)
constexpr int kTileRows = 16;  // input rows per packed block (two vectors)
constexpr int kTileWeights = 6;  // weight rows per tile: 12 accumulators, 2 inputs, 1 broadcast of 16 registers
constexpr int64_t kChunkRows = 128;  // rows packed per pass: the weights are widened once per pass
constexpr int64_t kBlockK = 512;  // columns per pass over the blocks: a tile's weights stay in L1 across them

inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Input rows m0..m0+7 (zeros past M) into lanes lane0..lane0+7 of a packed block [K][16].
template <typename T>
void pack_rows(const T* x, int64_t M, int64_t m0, int64_t K, float* block, int lane0) {
  int64_t k = 0;
  if (m0 + 8 <= M)
    for (; k + 8 <= K; k += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(x + (m0 + i) * K + k);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(block + (k + j) * kTileRows + lane0, r[j]);
    }
  for (; k < K; ++k)
    for (int i = 0; i < 8; ++i) block[k * kTileRows + lane0 + i] = m0 + i < M ? widen(x[(m0 + i) * K + k]) : 0.f;
}

// NR weight rows (float32, row stride ldw) against V vectors of packed input rows over kc columns, added to
// out [NR][16] (or written there, when `first`).
template <int NR, int V>
inline void outer_tile(const float* w, int64_t ldw, const float* block, int64_t kc, float* out, bool first) {
  // Every loop over the tile fully unrolled, so that the compiler keeps the accumulators in registers.
  __m256 a[NR][V];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) a[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(out + r * kTileRows + v * 8);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 xv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) xv[v] = _mm256_loadu_ps(block + k * kTileRows + v * 8);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const __m256 wv = _mm256_broadcast_ss(w + r * ldw + k);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) a[r][v] = _mm256_fmadd_ps(wv, xv[v], a[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(out + r * kTileRows + v * 8, a[r][v]);
}

template <int NR>
inline void outer_tile_rows(const float* w, int64_t ldw, const float* block, int64_t kc, int64_t rows, float* out,
                            bool first) {
  if (rows > 8)
    outer_tile<NR, 2>(w, ldw, block, kc, out, first);
  else
    outer_tile<NR, 1>(w, ldw, block, kc, out, first);
}

inline void weight_tile(int nr, const float* w, int64_t ldw, const float* block, int64_t kc, int64_t rows, float* out,
                        bool first) {
  switch (nr) {
    case 6: outer_tile_rows<6>(w, ldw, block, kc, rows, out, first); break;
    case 5: outer_tile_rows<5>(w, ldw, block, kc, rows, out, first); break;
    case 4: outer_tile_rows<4>(w, ldw, block, kc, rows, out, first); break;
    case 3: outer_tile_rows<3>(w, ldw, block, kc, rows, out, first); break;
    case 2: outer_tile_rows<2>(w, ldw, block, kc, rows, out, first); break;
    default: outer_tile_rows<1>(w, ldw, block, kc, rows, out, first); break;
  }
}

// The weight rows of one tile (rows x K) as float32: bf16, int8 or fp8 widened into `scratch`, each column times
// its group's scale where `group` is set (scale: the tile's rows' [rows, K / group]; the dequantized weight), float32
// used in place.
inline const float* tile_weights(const float* w, int64_t, int64_t, const float*, int64_t, std::vector<float>&) {
  return w;
}
template <typename WT>
inline const float* tile_weights(const WT* w, int64_t rows, int64_t K, const float* scale, int64_t group,
                                 std::vector<float>& scratch) {
  float* out = scratch.data();
  if (group) {
    for (int64_t g = 0; g < rows * K / group; ++g) {
      const __m256 s = _mm256_set1_ps(scale[g]);
      for (int64_t i = g * group; i < (g + 1) * group; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(load8(w + i), s));
    }
    return out;
  }
  int64_t i = 0;
  for (; i + 8 <= rows * K; i += 8) _mm256_storeu_ps(out + i, load8(w + i));
  for (; i < rows * K; ++i) out[i] = widen(w[i]);
  return out;
}

// Up to kChunkRows rows of x [M, K] against w [N, K] (int8 or fp8 with scale [N]: each sum times its row's scale;
// with scale [N, K / group]: the weight dequantized per tile): pack the rows, then each thread takes tiles of weight
// rows, widens one, and runs every block of rows over it, kBlockK columns at a time.
template <typename T, typename WT>
void gemm_chunk(const T* x, const WT* w, const T* bias, const float* scale, int64_t group, T* y, int64_t M, int64_t N,
                int64_t K, std::vector<float>& packed) {
  const int64_t blocks = (M + kTileRows - 1) / kTileRows, tiles = (N + kTileWeights - 1) / kTileWeights;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t half = 0; half < 2 * blocks; ++half)
      pack_rows(x, M, half * 8, K, packed.data() + (half / 2) * K * kTileRows, (half % 2) * 8);
    std::vector<float> scratch(kTileWeights * K), sums(blocks * kTileWeights * kTileRows);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t n0 = t * kTileWeights;
      const int nr = int(std::min<int64_t>(kTileWeights, N - n0));
      const float* wt = tile_weights(w + n0 * K, nr, K, group ? scale + n0 * (K / group) : nullptr, group, scratch);
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK)
        for (int64_t b = 0; b < blocks; ++b)
          weight_tile(nr, wt + k0, K, packed.data() + (b * K + k0) * kTileRows, std::min(kBlockK, K - k0),
                      std::min<int64_t>(kTileRows, M - b * kTileRows), sums.data() + b * kTileWeights * kTileRows,
                      k0 == 0);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m0 = b * kTileRows, rows = std::min<int64_t>(kTileRows, M - m0);
        const float* out = sums.data() + b * kTileWeights * kTileRows;
        for (int r = 0; r < nr; ++r) {
          const float add = bias ? widen(bias[n0 + r]) : 0.f, times = scale && !group ? scale[n0 + r] : 1.f;
          for (int64_t m = 0; m < rows; ++m) store(out[r * kTileRows + m] * times + add, y + (m0 + m) * N + n0 + r);
        }
      }
    }
  }
}

// x [M, K], w [N, K], bias [N] or null, y [M, N], all T (float or bf16 bits); or w int8 or fp8 e4m3 with scale
// [N] (group 0) or [N, K / group] (a multiple of 8).
template <typename T, typename WT = T>
void gemm(const T* x, const WT* w, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
          const float* scale = nullptr, int64_t group = 0) {
  std::vector<float> packed(std::min(M + kTileRows, kChunkRows) * K);
  for (int64_t m0 = 0; m0 < M; m0 += kChunkRows)
    gemm_chunk(x + m0 * K, w, bias, scale, group, y + m0 * N, std::min(kChunkRows, M - m0), N, K, packed);
}

}  // namespace pagedserve
#endif
