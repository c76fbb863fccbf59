// y = x W^T + b for bf16 x on CPUs with AVX-512 BF16, from W repacked once into "pairs" tiles: 32 output rows at a
// time, column pairs outermost, so that one 512-bit load holds one column pair of 16 output rows (bf16 W; an int8 W's
// tile holds 32 rows' pairs in 64 bytes, converted exactly to bf16 in registers: |q| <= 128 has at most 8 significant
// bits, and each int8 row's float32 scale multiplies its sum once). Each input row's pair is broadcast and vdpbf16ps
// adds both products into those 16 rows' float32 sums: no sum is ever added across lanes, each weight tile streams
// from memory once per call and stays in L1 while groups of 8 input rows pass over it. Every output's sum runs over
// the column pairs in order in one lane, whatever the row count, tiling or threads, so a row's result does not depend
// on the rows beside it. One rounding to bf16.
#pragma once
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>

#include "common.h"
#include "fp8.h"

namespace pagedserve {

// Output rows per tile, and input rows per pass over a tile (2 x 8 sums in registers).
constexpr int64_t kPairTileRows = 32, kPairGroupRows = 8;

// Column pair p of a tile's 32 rows as bf16 pairs: rows 0..15 in w0, 16..31 in w1.
struct Bf16Pairs {
  const uint16_t* tile;
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    w0 = (__m512bh)_mm512_loadu_si512(tile + p * 64);
    w1 = (__m512bh)_mm512_loadu_si512(tile + p * 64 + 32);
  }
};

// ... of an int8 tile, each column pair's 64 bytes ordered as vpunpck{l,h}bw interleave them (cpu_gemv.py's
// pair_weight): each byte's bf16 looked up by |q| (vpermi2b: the low and the high byte of bf16(|q|), q's sign
// added to the high byte), the bytes then interleaved into words. -128's |q| reads entry 0, whose high byte is
// 128's (0x43, with the sign 0xC3: bf16 -128), and 0 is zeroed by its mask instead.
#ifdef __AVX512VBMI__
// The low bytes of bf16(i) for i = 0..127, then the high bytes; entry 0 holds bf16(zero)'s.
inline std::array<uint8_t, 256> bf16_byte_table(float zero) {
  std::array<uint8_t, 256> bytes{};
  for (int i = 0; i < 128; ++i) {
    const uint16_t bits = uint16_t(float_bits(i ? float(i) : zero) >> 16);
    bytes[i] = uint8_t(bits & 0xFF), bytes[128 + i] = uint8_t(bits >> 8);
  }
  return bytes;
}

// The conversion of Int8Pairs and of Int8PairsBarMin (and fp8_pairs.h's Fp8Pairs, whose table is fp8.h's): each
// byte's bf16 by its magnitude's entry (vpermt2b reads a byte's low 7 bits), its sign put in. Masked zeroes the
// bytes of q = 0 (entry 0 being 128's).
template <bool Masked, typename Q = int8_t>
struct Int8Lookup {
  const Q* tile;
  __m512i low0, low1, high0, high1;
  Int8Lookup(const Q* t, const uint8_t* table) : tile(t) {
    low0 = _mm512_loadu_si512(table), low1 = _mm512_loadu_si512(table + 64);
    high0 = _mm512_loadu_si512(table + 128), high1 = _mm512_loadu_si512(table + 192);
  }
  void convert(__m512i q, __m512i magnitude, __m512bh& w0, __m512bh& w1) const {
    const __mmask64 lanes = Masked ? _mm512_test_epi8_mask(q, q) : ~__mmask64(0);
    const __m512i low = _mm512_maskz_permutex2var_epi8(lanes, low0, magnitude, low1);
    const __m512i high = _mm512_ternarylogic_epi32(_mm512_maskz_permutex2var_epi8(lanes, high0, magnitude, high1),
                                                   q, _mm512_set1_epi8(char(0x80)), 0xF8);  // high | (q & 0x80)
    w0 = (__m512bh)_mm512_unpacklo_epi8(low, high);
    w1 = (__m512bh)_mm512_unpackhi_epi8(low, high);
  }
};

struct Int8Pairs : Int8Lookup<true> {
  explicit Int8Pairs(const int8_t* t) : Int8Lookup(t, table().data()) {}
  static const std::array<uint8_t, 256>& table() {
    static const auto bytes = bf16_byte_table(128.f);  // built once
    return bytes;
  }
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    const __m512i q = _mm512_loadu_si512(tile + p * 64);
    convert(q, _mm512_abs_epi8(q), w0, w1);
  }
};

// Int8Pairs without the zero mask (entry 0 is 0's): a vector op fewer per 64 weights, which at one row bound the
// products rather than the bytes (python benchmarks/cpu_gemv_int8.py --rows 1), exact for every q but -128, read as
// -0. It keeps the least q it read, so that the caller can tell a tile holding -128 and read it again with Int8Pairs
// (online quantization's int8 weights lie in [-127, 127]; a checkpoint's may hold -128).
struct Int8PairsBarMin : Int8Lookup<false> {
  mutable __m512i least = _mm512_setzero_si512();
  explicit Int8PairsBarMin(const int8_t* t) : Int8Lookup(t, table().data()) {}
  static const std::array<uint8_t, 256>& table() {
    static const auto bytes = bf16_byte_table(0.f);
    return bytes;
  }
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    const __m512i q = _mm512_loadu_si512(tile + p * 64);
    least = _mm512_min_epi8(least, q);
    convert(q, _mm512_abs_epi8(q), w0, w1);
  }
  bool read_min() const { return _mm512_cmpeq_epi8_mask(least, _mm512_set1_epi8(char(-128))) != 0; }
};
#else
struct Int8Pairs {  // without AVX-512 VBMI: bytes sign-extended to words in the same order, converted by way of float32
  const int8_t* tile;
  explicit Int8Pairs(const int8_t* t) : tile(t) {}
  static __m512bh bf16_of(__m512i words) {
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(words)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(words, 1)));
    return _mm512_cvtne2ps_pbh(high, low);
  }
  PAGEDSERVE_ALWAYS_INLINE void operator()(int64_t p, __m512bh& w0, __m512bh& w1) const {
    const __m512i q = _mm512_loadu_si512(tile + p * 64);
    const __m512i sign = _mm512_movm_epi8(_mm512_movepi8_mask(q));
    w0 = bf16_of(_mm512_unpacklo_epi8(q, sign));
    w1 = bf16_of(_mm512_unpackhi_epi8(q, sign));
  }
};
#endif
inline Bf16Pairs pairs_of(const uint16_t* tile) { return {tile}; }
inline Int8Pairs pairs_of(const int8_t* tile) { return Int8Pairs(tile); }

// Column pair p's lines of a tile read next into L2: a column pair's 64 weights, two lines of bf16, one of int8.
template <typename W>
inline void prefetch_pair(const W* next, int64_t p) {
  const char* line = reinterpret_cast<const char*>(next + p * 64);
  _mm_prefetch(line, _MM_HINT_T1);
  if constexpr (sizeof(W) == 2) _mm_prefetch(line + 64, _MM_HINT_T1);
}

// One input row's sums over a tile's 32 output rows (a[h]: rows 16 h..16 h+16), each times s[i] (s: null for none)
// plus b[i], rounded into `to`'s first `count` outputs.
inline void store_row_sums(const __m512 (&a)[2], const float* s, const float* b, uint16_t* to, int64_t count) {
  // A whole tile's outputs go straight to y; a last, partial one's through a buffer (a memcpy call per row and tile
  // was ~9% of the samples of 8-row demo decode steps).
  alignas(64) uint16_t out[32];
  uint16_t* at = count == 32 ? to : out;
  for (int h = 0; h < 2; ++h) {
    const __m512 bh = _mm512_load_ps(b + 16 * h);
    const __m512 sums = s ? _mm512_fmadd_ps(a[h], _mm512_load_ps(s + 16 * h), bh) : _mm512_add_ps(a[h], bh);
    store8(_mm512_castps512_ps256(sums), at + 16 * h);  // common.h's rounding, 8 lanes at a time
    store8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)), at + 16 * h + 8);
  }
  if (count < 32) std::memcpy(to, out, count * sizeof(uint16_t));
}

// Input rows m0..m0+MB's sums over a tile of output rows n0..n0+32 (a[m][h]: rows 16 h..16 h+16), each times its
// row's scale (scale: the tile's first row's; null: none) plus its bias, rounded into y.
template <int MB>
inline void store_tile_sums(const __m512 (&a)[MB][2], const float* scale, const uint16_t* bias, uint16_t* y, int64_t n0,
                            int64_t m0, int64_t N) {
  const int64_t count = std::min<int64_t>(32, N - n0);
  alignas(64) float b[32] = {}, s[32];
  for (int64_t i = 0; bias && i < count; ++i) b[i] = widen(bias[n0 + i]);
  for (int64_t i = 0; scale && i < 32; ++i) s[i] = i < count ? scale[i] : 0.f;
  for (int m = 0; m < MB; ++m) store_row_sums(a[m], scale ? s : nullptr, b, y + (m0 + m) * N + n0, count);
}

// Input rows m0..m0+MB against the tile of output rows n0..n0+32 (tile: [K / 2 pairs][32 rows][2], zero past N
// and K), each sum times its row's scale (scale: the tile's first row's; null: none). next: a tile of the same size
// that the caller reads after this one, or null: its lines are prefetched into L2 as this tile's stream in, a whole
// tile ahead of use, which the hardware prefetchers alone do not reach. weights: the tile's pairs functor.
template <int MB, typename W, typename Pairs>
inline void pair_tile_of(const Pairs& weights, const uint16_t* x, const float* scale, const uint16_t* bias,
                         uint16_t* y, int64_t n0, int64_t m0, int64_t N, int64_t K, const W* next) {
  __m512 a[MB][2];
  for (int m = 0; m < MB; ++m) a[m][0] = a[m][1] = _mm512_setzero_ps();
  auto step = [&](int64_t p, auto pair_of) {
    __m512bh w0, w1;
    weights(p, w0, w1);
    if (next) prefetch_pair(next, p);
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
  store_tile_sums<MB>(a, scale, bias, y, n0, m0, N);
}

// pair_tile_of the tile's pairs_of.
template <int MB, typename W>
inline void pair_tile(const W* tile, const uint16_t* x, const float* scale, const uint16_t* bias, uint16_t* y,
                      int64_t n0, int64_t m0, int64_t N, int64_t K, const W* next = nullptr) {
  pair_tile_of<MB>(pairs_of(tile), x, scale, bias, y, n0, m0, N, K, next);
}

// Input rows m0..m0+MB (at most 8) against one tile's pairs functor (next: as pair_tile's).
template <typename Pairs, typename W = uint16_t>
inline void pair_group_of(const Pairs& weights, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0,
                          int64_t m0, int64_t MB, int64_t N, int64_t K, const float* scale = nullptr,
                          const W* next = nullptr) {
  switch (MB) {
    case 8: pair_tile_of<8>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 7: pair_tile_of<7>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 6: pair_tile_of<6>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 5: pair_tile_of<5>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 4: pair_tile_of<4>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 3: pair_tile_of<3>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    case 2: pair_tile_of<2>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
    default: pair_tile_of<1>(weights, x, scale, bias, y, n0, m0, N, K, next); break;
  }
}

// Input rows m0..m0+MB (at most 8) against one tile (next: as pair_tile's).
template <typename W>
inline void pair_group(const W* tile, const uint16_t* x, const uint16_t* bias, uint16_t* y, int64_t n0, int64_t m0,
                       int64_t MB, int64_t N, int64_t K, const float* scale = nullptr, const W* next = nullptr) {
  pair_group_of(pairs_of(tile), x, bias, y, n0, m0, MB, N, K, scale, next);
}

// What gemv_pairs does besides its products: prepare() on every thread as its parallel region starts (a worksharing
// loop there ends in a barrier before any product), after_item(n0, count, m0, rows) on the thread that has just written
// outputs n0..n0 + count of rows m0..m0 + rows. By default nothing.
struct NoItemHooks {
  void prepare() const {}
  void after_item(int64_t, int64_t, int64_t, int64_t) const {}
};

// x [M, K], pairs: W [N, K] (bf16, or int8 with scale [N]; bf16: scale null) as [ceil(N / 32)][ceil(K / 2)][32][2]
// (kernels/cpu_gemv.py's pair_weight), bias [N] or null, y [M, N]. Threads split (tile, group of 8 input rows) items,
// consecutive groups of a tile to one thread; a tile's first group prefetches the next tile; hooks as NoItemHooks.
template <typename W, typename Hooks = NoItemHooks>
void gemv_pairs(const uint16_t* x, const W* pairs, const float* scale, const uint16_t* bias, uint16_t* y, int64_t M,
                int64_t N, int64_t K, const Hooks& hooks = {}) {
  const int64_t tiles = (N + kPairTileRows - 1) / kPairTileRows, groups = (M + kPairGroupRows - 1) / kPairGroupRows;
  const int64_t tile_elems = (K + 1) / 2 * 2 * kPairTileRows;
#pragma omp parallel
  {
    hooks.prepare();
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tiles * groups; ++item) {
      const int64_t t = item / groups, m0 = item % groups * kPairGroupRows;
      const int64_t rows = std::min(kPairGroupRows, M - m0), n0 = t * kPairTileRows;
      pair_group(pairs + t * tile_elems, x, bias, y, n0, m0, rows, N, K, scale ? scale + n0 : nullptr,
                 m0 == 0 && t + 1 < tiles ? pairs + (t + 1) * tile_elems : nullptr);
      hooks.after_item(n0, std::min(kPairTileRows, N - n0), m0, rows);
    }
  }
}

inline void gemv_pairs_bf16(const uint16_t* x, const uint16_t* pairs, const uint16_t* bias, uint16_t* y, int64_t M,
                            int64_t N, int64_t K) {
  gemv_pairs(x, pairs, nullptr, bias, y, M, N, K);
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
