// Adapter (LoRA) deltas of a projection for the rows of a step that run with an adapter, as workers/lora/slots.py
// adds them: y = round(y + (x A_s^T) B_s^T) for row slot s, the two products and the sum rounded to the adapters'
// compute dtype C (float32 where the CPU emulates bf16 GEMMs, else the model dtype).
#pragma once
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

// The adapted rows' shrunk activations, then their deltas, each spread over the threads by output element (at
// batch 1 one row's products would otherwise run on one thread); every element as the one-row loop computes it.
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
#pragma omp parallel if (R * (N + K) * W >= (int64_t(1) << 14))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * W; ++i) {
      const int64_t m = rows[i / W], j = i % W;
      shrunk[i] = widen(round_to<C>(dot(A + (slots[m] * W + j) * K, x + m * K, K)));
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * N; ++i) {
      const int64_t r = i / N, n = i % N, m = rows[r];
      const float delta = widen(round_to<C>(dot(B + (slots[m] * N + n) * W, shrunk.data() + r * W, W)));
      y[m * N + n] = round_to<T>(widen(round_to<C>(widen(y[m * N + n]) + delta)));
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
