// Adapter (LoRA) deltas of a projection for the rows of a step that run with an adapter, as workers/lora/slots.py
// adds them: y = round(y + (x A_s^T) B_s^T) for row slot s, the two products and the sum rounded to the adapters'
// compute dtype C (float32 where the CPU emulates bf16 GEMMs, else the model dtype).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "layer_ops.h"

namespace pagedserve {

// A projection's adapter slots: a [slots, width, K] and bt [slots, width, N] (B transposed) of C (bf16 when `bf16`,
// else float32), used[s] nonzero where slot s holds an adapter; null a: none. A merged projection (q/k/v, gate/up)
// stacks its parts: part p's rank = width / parts rows of a, and its outputs offsets[p]..offsets[p + 1] read only
// those rows of bt (zero elsewhere: those products are skipped).
struct LoraSlots {
  const void* a = nullptr;
  const void* bt = nullptr;
  const uint8_t* used = nullptr;
  int64_t width = 0;
  bool bf16 = false;
  const int64_t* offsets = nullptr;  // [parts + 1]; null: one part of all N outputs
  int64_t parts = 1;
};

// sum of a[i] * b[i] over n, in float32 (8 lanes at a time where AVX2 allows).
template <typename A, typename B>
float dot(const A* a, const B* b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#ifdef __AVX2__
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) lanes = _mm256_fmadd_ps(load8(a + i), load8(b + i), lanes);
  sum = hsum(lanes);
#endif
  for (; i < n; ++i) sum += widen(a[i]) * widen(b[i]);
  return sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// load16 of the first n < 16 elements, the other lanes 0 (nothing past them is read).
inline __m512 load16_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
inline __m512 load16_first(const uint16_t* p, int64_t n) {
  const __m512i halves = _mm512_maskz_loadu_epi16(__mmask32((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(halves)), 16));
}
#endif

// out[i] = the float32 sum of rows[i * stride + k] * v[k] over k < n, for i < count <= 16: sixteen rows at a time
// in 16 lanes, their sums transposed in one tree (an adapter's shrink: one dot per row would spend more on its
// horizontal sums than on its products). bf16 rows and v on AVX-512 BF16: pairs of products.
template <typename R, typename V>
void dots(const R* rows, int64_t stride, int64_t count, const V* v, int64_t n, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const R* row[16];
  for (int i = 0; i < 16; ++i) row[i] = rows + std::min<int64_t>(i, count - 1) * stride;  // lanes past count: ignored
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<R, uint16_t> && std::is_same_v<V, uint16_t>) {
    for (; k < n; k += 32) {
      const __mmask32 first = n - k >= 32 ? ~__mmask32(0) : __mmask32((1u << (n - k)) - 1);
      const __m512bh vk = (__m512bh)_mm512_maskz_loadu_epi16(first, v + k);
      for (int i = 0; i < 16; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(first, row[i] + k), vk);
    }
  }
#endif
  for (; k + 16 <= n; k += 16) {
    const __m512 vk = load16(v + k);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(load16(row[i] + k), vk, acc[i]);
  }
  if (k < n) {
    const __m512 vk = load16_first(v + k, n - k);
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(load16_first(row[i] + k, n - k), vk, acc[i]);
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes_16(acc));
  for (int64_t i = 0; i < count; ++i) out[i] = sums[i];
#else
  for (int64_t i = 0; i < count; ++i) out[i] = dot(rows + i * stride, v, n);
#endif
}

// out[c] = round_T(round_C(out[c] + round_C(delta[c]))) for c < count <= 16.
template <typename T, typename C>
void add_deltas(T* out, const float* delta, int64_t count) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (count == 16) {
    const __m512 sum = round16<C>(_mm512_add_ps(load16(out), round16<C>(_mm512_loadu_ps(delta))));
    if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t>)  // bf16 already: its upper halves
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(sum), 16)));
    else
      store16(sum, out);
    return;
  }
#endif
  for (int64_t c = 0; c < count; ++c)
    out[c] = round_to<T>(widen(round_to<C>(widen(out[c]) + widen(round_to<C>(delta[c])))));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kLoraRowBlock = 8;  // rows whose sums a tile's columns pass over together (8 chains of products)

// 16 lanes of the first count <= 16 elements (zero past them, nothing past them read), as 32-bit integers.
inline __m512i lanes_of(const uint16_t* p, __mmask16 first) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first, p));
}

// Each row's delta (rows of s, stride W: the part's `rank` columns) for count <= 16 outputs of bt (its rank rows of
// stride N at the tile's first output), added to out (each row's outputs there, stride N). bt's columns are laid
// into a tile once, then every row's products run over it in 16 lanes, kLoraRowBlock rows at a time.
template <typename T, typename C>
void add_tile_deltas(const C* bt, int64_t N, int64_t count, int64_t rank, const C* s, int64_t W, const int64_t* rows,
                     int64_t R, T* out, std::vector<float>& tile) {
  const __mmask16 first = __mmask16((1u << count) - 1);
  // kLoraRowBlock rows from r0 on while that many remain, then one at a time (a step of few rows, batch 1's above
  // all, would otherwise compute a whole block for each of them).
  auto add_block = [&](int64_t r0, auto product, int64_t steps, auto block) {
    constexpr int64_t B = decltype(block)::value;
    const C* row[B];
    for (int64_t r = 0; r < B; ++r) row[r] = s + (r0 + r) * W;
    __m512 acc[B];
    for (int64_t r = 0; r < B; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t q = 0; q < steps; ++q)
      for (int64_t r = 0; r < B; ++r) acc[r] = product(acc[r], _mm512_loadu_ps(&tile[16 * q]), row[r], q);
    alignas(64) float sums[16];
    for (int64_t r = 0; r < B; ++r) {
      _mm512_store_ps(sums, acc[r]);
      add_deltas<T, C>(out + rows[r0 + r] * N, sums, count);
    }
  };
  auto add_rows = [&](auto product, int64_t steps) {
    int64_t r0 = 0;
    for (; r0 + kLoraRowBlock <= R; r0 += kLoraRowBlock)
      add_block(r0, product, steps, std::integral_constant<int64_t, kLoraRowBlock>{});
    for (; r0 < R; ++r0) add_block(r0, product, steps, std::integral_constant<int64_t, 1>{});
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, uint16_t>) {  // bf16 pairs of columns: (column 2q, 2q + 1) in each lane
    const int64_t pairs = (rank + 1) / 2;
    tile.resize(16 * pairs);
    for (int64_t q = 0; q < pairs; ++q) {
      const __m512i low = lanes_of(bt + 2 * q * N, first);
      const __m512i high = 2 * q + 1 < rank ? lanes_of(bt + (2 * q + 1) * N, first) : _mm512_setzero_si512();
      _mm512_storeu_si512(&tile[16 * q], _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
    }
    auto product = [rank](__m512 acc, __m512 columns, const uint16_t* row, int64_t q) {
      int32_t pair = row[2 * q];  // an odd rank's last column alone
      if (2 * q + 1 < rank) std::memcpy(&pair, row + 2 * q, 4);
      return _mm512_dpbf16_ps(acc, (__m512bh)columns, (__m512bh)_mm512_set1_epi32(pair));
    };
    add_rows(product, pairs);
    return;
  }
#endif
  tile.resize(16 * rank);
  for (int64_t j = 0; j < rank; ++j) {
    if constexpr (std::is_same_v<C, float>)
      _mm512_storeu_ps(&tile[16 * j], _mm512_maskz_loadu_ps(first, bt + j * N));
    else
      _mm512_storeu_si512(&tile[16 * j], _mm512_slli_epi32(lanes_of(bt + j * N, first), 16));
  }
  auto product = [](__m512 acc, __m512 column, const C* row, int64_t j) {
    return _mm512_fmadd_ps(_mm512_set1_ps(widen(row[j])), column, acc);
  };
  add_rows(product, rank);
}
#endif

// The same deltas one output at a time (CPUs without AVX-512).
template <typename T, typename C>
void add_tile_deltas_scalar(const C* bt, int64_t N, int64_t count, int64_t rank, const C* s, int64_t W,
                            const int64_t* rows, int64_t R, T* out) {
  for (int64_t r = 0; r < R; ++r) {
    float delta[16] = {};
    for (int64_t j = 0; j < rank; ++j)
      for (int64_t c = 0; c < count; ++c) delta[c] += widen(s[r * W + j]) * widen(bt[j * N + c]);
    add_deltas<T, C>(out + rows[r] * N, delta, count);
  }
}

// The rows of a step with an adapter in their slot (slots[m] >= 0 and used).
inline std::vector<int64_t> adapted_rows(const LoraSlots& L, int64_t M, const int64_t* slots) {
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (slots[m] >= 0 && L.used[slots[m]]) rows.push_back(m);
  return rows;
}

// Row m's shrunk activations j..j + 16 (fewer at the end) of x[m] A_s^T for its slot s, rounded to C, into out[j..].
template <typename T, typename C>
void shrink_block(const LoraSlots& L, const T* x, int64_t m, int64_t j, int64_t K, const int64_t* slots, C* out) {
  const int64_t count = std::min<int64_t>(16, L.width - j);
  float sums[16];
  dots(static_cast<const C*>(L.a) + (slots[m] * L.width + j) * K, K, count, x + m * K, K, sums);
  for (int64_t c = 0; c < count; ++c) out[j + c] = round_to<C>(sums[c]);
}

// Item i of the adapted rows' shrink (rows[i / b]'s activations 16 (i % b).. for b = ceil(width / 16)): into that
// row's width of shrunk [rows, width].
template <typename T, typename C>
void shrink_item(const LoraSlots& L, const T* x, const int64_t* rows, int64_t i, int64_t K, const int64_t* slots,
                 C* shrunk) {
  const int64_t blocks = (L.width + 15) / 16;
  shrink_block(L, x, rows[i / blocks], i % blocks * 16, K, slots, shrunk + i / blocks * L.width);
}

// The adapted rows, grouped into runs of one slot (runs[i]..runs[i + 1] of rows); their shrunk activations, then
// each run's deltas for each tile of 16 outputs of a part (bt's tile read once per run), spread over the threads.
template <typename T, typename C>
void add_lora_rows(const LoraSlots& L, const T* x, T* y, int64_t M, int64_t N, int64_t K, const int64_t* slots) {
  const C* Bt = static_cast<const C*>(L.bt);
  const int64_t W = L.width, rank = W / L.parts;
  std::vector<int64_t> rows = adapted_rows(L, M, slots), runs;
  const int64_t R = int64_t(rows.size());
  if (R == 0) return;
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  for (int64_t r = 0; r < R; ++r)
    if (r == 0 || slots[rows[r]] != slots[rows[r - 1]]) runs.push_back(r);
  runs.push_back(R);
  std::vector<int64_t> tiles;  // (part, first output) of each tile
  auto part_end = [&](int64_t p) { return L.offsets ? L.offsets[p + 1] : N; };
  for (int64_t p = 0; p < L.parts; ++p)
    for (int64_t n0 = L.offsets ? L.offsets[p] : 0; n0 < part_end(p); n0 += 16) tiles.insert(tiles.end(), {p, n0});
  const int64_t tile_count = int64_t(tiles.size()) / 2, run_count = int64_t(runs.size()) - 1;
  const int64_t width_blocks = (W + 15) / 16;
  std::vector<C> shrunk(R * W);
#pragma omp parallel if (R * (W * K + rank * N) >= kParallelMinElements)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * width_blocks; ++i) shrink_item(L, x, rows.data(), i, K, slots, shrunk.data());
#if defined(__AVX512F__) && defined(__AVX512BW__)
    std::vector<float> tile;  // a tile's columns, 16 lanes each
#endif
#pragma omp for schedule(static) nowait
    for (int64_t i = 0; i < run_count * tile_count; ++i) {
      const int64_t run = i / tile_count, part = tiles[2 * (i % tile_count)], n0 = tiles[2 * (i % tile_count) + 1];
      const int64_t first = runs[run], count = std::min<int64_t>(16, part_end(part) - n0);
      const C* bt = Bt + (slots[rows[first]] * W + part * rank) * N + n0;
      const C* s = shrunk.data() + first * W + part * rank;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      add_tile_deltas<T, C>(bt, N, count, rank, s, W, rows.data() + first, runs[run + 1] - first, y + n0, tile);
#else
      add_tile_deltas_scalar<T, C>(bt, N, count, rank, s, W, rows.data() + first, runs[run + 1] - first, y + n0);
#endif
    }
  }
}

// y [M, N] of x [M, K]: each row with an adapter in its slot (slots[m] >= 0; null slots: no row) gets its delta.
template <typename T>
void add_lora(const LoraSlots& L, const T* x, T* y, int64_t M, int64_t N, int64_t K, const int64_t* slots) {
  if (!L.a || !slots) return;
  if (L.bf16)
    add_lora_rows<T, uint16_t>(L, x, y, M, N, K, slots);
  else
    add_lora_rows<T, float>(L, x, y, M, N, K, slots);
}

}  // namespace pagedserve
