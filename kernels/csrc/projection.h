// A projection of the C++ decoder layer (Projection): its weight of the model dtype, int8 or fp8 with scales or 4-bit
// with scales and zero points, its pairs copy and its adapters, and project(), the one place that picks the product
// for it.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "fp8_pairs.h"
#include "gemv.h"
#include "gemv_pairs.h"
#include "int8_pairs.h"
#include "int4.h"
#include "lora.h"
#include "lora_row_deltas.h"

namespace pagedserve {

// A projection's weight: T, or int8, fp8 e4m3 or 4-bit (int4.h) with a float32 scale per output row or per group of
// input columns (weight-only quantization).
struct Projection {
  const void* weight;
  const float* scale;  // null: the weight is of the model dtype
  int64_t group;  // 0: one scale per row; else the columns sharing a scale (scale is [N, K / group])
  // a bf16 weight's gemv_pairs.h copy (an int8 one's with a scale per row: int8 pairs; an fp8 one's: fp8_pairs.h's;
  // a 4-bit one's: int4.h's), which its products then read; or null
  const uint16_t* pairs = nullptr;
  LoraSlots lora;  // its adapter slots (lora.h), or none
  bool fp8 = false;  // a scaled weight's elements: fp8 e4m3, else int8 (or 4-bit)
  const float* zero = nullptr;  // a 4-bit weight's zero points, like scale (null: 8)
  bool int4 = false;  // a scaled weight's elements: 4-bit, packed two a byte
};

// y = x W^T + b from W's pairs copy where it has one (bf16 on AVX-512 BF16 CPUs), else from W.
template <typename T>
void products(const T* x, const T* w, const uint16_t* pairs, const T* bias, T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs) return gemv_pairs_bf16(x, pairs, bias, y, M, N, K);
#endif
  gemv(x, w, bias, y, M, N, K);
}

// y = x (W * scale)^T + b for an int8 W, from its int8 pairs copy where it has one (a scale per row, bf16 rows, on
// AVX-512 BF16 CPUs), else from W.
template <typename T>
void int8_products(const T* x, const int8_t* w, const int8_t* pairs, const float* scale, int64_t group, const T* bias,
                   T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs && !group) return gemv_pairs_int8(x, pairs, scale, bias, y, M, N, K);
#endif
  gemv_scaled(x, w, scale, group, bias, y, M, N, K);
}

// y = x (W * scale)^T + b for an fp8 e4m3 W, from its pairs copy where it has one (bf16 rows on AVX-512 BF16 and VBMI
// CPUs), else from W.
template <typename T>
void fp8_products(const T* x, const Fp8E4m3* w, const uint8_t* pairs, const float* scale, int64_t group, const T* bias,
                  T* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, uint16_t>)
    if (pairs) return gemv_pairs_fp8(x, pairs, group ? group : K, bias, y, M, N, K);
#endif
  gemv_scaled(x, w, scale, group, bias, y, M, N, K);
}

// Whether p's products read its bf16 pairs copy (as project() reads it).
inline bool paired(const Projection& p) { return p.pairs && !p.scale; }

// Whether p's bf16 pairs product added the adapted rows' deltas to y, each thread to the outputs it computed.
template <typename T>
bool pairs_with_deltas(const Projection& p, const T* x, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
                       const int64_t* lora_slots) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (!paired(p) || !p.lora.a || !lora_slots) return false;
    std::vector<int64_t> rows = adapted_rows(p.lora, M, lora_slots);
    if (p.lora.bf16)
      gemv_pairs(x, p.pairs, nullptr, bias, y, M, N, K,
                 RowDeltas<T, uint16_t>(p.lora, x, y, M, N, K, lora_slots, std::move(rows)));
    else
      gemv_pairs(x, p.pairs, nullptr, bias, y, M, N, K,
                 RowDeltas<T, float>(p.lora, x, y, M, N, K, lora_slots, std::move(rows)));
    return true;
  }
#endif
  return false;
}

// y = x W^T + b, then each adapted row's delta (lora_slots: each row's adapter slot, -1 none; null: no row).
template <typename T>
void project(const Projection& p, const T* x, const T* bias, T* y, int64_t M, int64_t N, int64_t K,
             const int64_t* lora_slots) {
  if (pairs_with_deltas(p, x, bias, y, M, N, K, lora_slots)) return;
  if (p.int4)
    int4_products(x, static_cast<const uint8_t*>(p.weight), reinterpret_cast<const uint8_t*>(p.pairs), p.scale,
                  p.zero, p.group, bias, y, M, N, K);
  else if (p.scale && p.fp8)
    fp8_products(x, static_cast<const Fp8E4m3*>(p.weight), reinterpret_cast<const uint8_t*>(p.pairs), p.scale,
                 p.group, bias, y, M, N, K);
  else if (p.scale)
    int8_products(x, static_cast<const int8_t*>(p.weight), reinterpret_cast<const int8_t*>(p.pairs), p.scale,
                  p.group, bias, y, M, N, K);
  else
    products(x, static_cast<const T*>(p.weight), p.pairs, bias, y, M, N, K);
  add_lora(p.lora, x, y, M, N, K, lora_slots);
}

}  // namespace pagedserve
