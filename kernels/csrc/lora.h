// Adapter (LoRA) deltas of a projection for the rows of a step that run with an adapter, as workers/lora/slots.py
// adds them: y = round(y + (x A_s^T) B_s^T) for row slot s, the two products and the sum rounded to the adapters'
// compute dtype C (float32 where the CPU emulates bf16 GEMMs, else the model dtype).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "layer_ops.h"

namespace pagedserve {

// A projection's adapter slots: a [slots, width, K] and b [slots, N, width] of C (bf16 when `bf16`, else float32),
// used[s] nonzero where slot s holds an adapter; null a: none.
struct LoraSlots {
  const void* a = nullptr;
  const void* b = nullptr;
  const uint8_t* used = nullptr;
  int64_t width = 0;
  bool bf16 = false;
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
// in 16 lanes, their sums transposed in one tree (one dot per row would spend more on its horizontal sum than on its
// products: a delta's dot is only the adapter's width long).
template <typename R, typename V>
void dots(const R* rows, int64_t stride, int64_t count, const V* v, int64_t n, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const R* row[16];
  for (int i = 0; i < 16; ++i) row[i] = rows + std::min<int64_t>(i, count - 1) * stride;  // lanes past count: ignored
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
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

// The adapted rows' shrunk activations, then their deltas, each spread over the threads by blocks of 16 output
// elements (at batch 1 one row's products would otherwise run on one thread).
template <typename T, typename C>
void add_lora_rows(const LoraSlots& L, const T* x, T* y, int64_t M, int64_t N, int64_t K, const int64_t* slots) {
  const C* A = static_cast<const C*>(L.a);
  const C* B = static_cast<const C*>(L.b);
  const int64_t W = L.width;
  std::vector<int64_t> rows;
  for (int64_t m = 0; m < M; ++m)
    if (slots[m] >= 0 && L.used[slots[m]]) rows.push_back(m);
  const int64_t R = int64_t(rows.size());
  if (R == 0) return;
  std::vector<float> shrunk(R * W);
  const int64_t width_blocks = (W + 15) / 16, output_blocks = (N + 15) / 16;
#pragma omp parallel if (R * (N + K) * W >= (int64_t(1) << 14))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * width_blocks; ++i) {
      const int64_t r = i / width_blocks, j = (i % width_blocks) * 16, m = rows[r];
      float* out = shrunk.data() + r * W + j;
      const int64_t count = std::min<int64_t>(16, W - j);
      dots(A + (slots[m] * W + j) * K, K, count, x + m * K, K, out);
      for (int64_t c = 0; c < count; ++c) out[c] = widen(round_to<C>(out[c]));
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * output_blocks; ++i) {
      const int64_t r = i / output_blocks, n0 = (i % output_blocks) * 16, m = rows[r];
      const int64_t count = std::min<int64_t>(16, N - n0);
      float delta[16];
      dots(B + (slots[m] * N + n0) * W, W, count, shrunk.data() + r * W, W, delta);
      for (int64_t c = 0; c < count; ++c) {
        T& out = y[m * N + n0 + c];
        out = round_to<T>(widen(round_to<C>(widen(out) + widen(round_to<C>(delta[c])))));
      }
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
