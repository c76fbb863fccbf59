// A layer's paged KV cache as the kernels write and read it: of the model dtype, or fp8 (e4m3 or e5m2) with one scale
// per tensor (kernels/kv_quant.py: stored = round(x / scale) saturated, read = stored * scale).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"
#include "fp8.h"

namespace pagedserve {

// Cache element types: T (the model dtype) or one of fp8.h's bytes.
constexpr int64_t kCacheModelDtype = 0, kCacheE4m3 = 1, kCacheE5m2 = 2;  // kernels/kv_quant.py CACHE_KINDS

struct KvCache {
  void *k = nullptr, *v = nullptr;  // [blocks, kv_heads, block_size, head_dim] of the element type `kind` names
  int64_t kind = kCacheModelDtype;
  float k_scale = 1.f, v_scale = 1.f;  // fp8 only
};

// float -> fp8 rounded to nearest even, as torch's c10::Float8_e4m3fn / Float8_e5m2 convert (the caller saturates
// first, so no value reaches their NaN / inf).
inline uint8_t to_fp8(float f, Fp8E4m3*) {
  uint32_t bits = float_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (1087u << 20)) {
    result = 0x7f;
  } else if (bits < (121u << 23)) {  // a subnormal: the FPU's rounding aligns it
    constexpr uint32_t denorm = 141u << 23;
    result = uint8_t(float_bits(bits_float(bits) + bits_float(denorm)) - denorm);
  } else {
    const uint32_t odd = (bits >> 20) & 1;
    bits += (uint32_t(7 - 127) << 23) + 0x7FFFF + odd;
    result = uint8_t(bits >> 20);
  }
  return result | uint8_t(sign >> 24);
}
inline uint8_t to_fp8(float f, Fp8E5m2*) {
  uint32_t bits = float_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  uint8_t result;
  if (bits >= (143u << 23)) {
    result = bits > (255u << 23) ? 0x7F : 0x7C;
  } else if (bits < (113u << 23)) {
    constexpr uint32_t denorm = 134u << 23;
    result = uint8_t(float_bits(bits_float(bits) + bits_float(denorm)) - denorm);
  } else {
    const uint32_t odd = (bits >> 21) & 1;
    bits += (uint32_t(15 - 127) << 23) + 0xFFFFF + odd;
    result = uint8_t(bits >> 21);
  }
  return result | uint8_t(sign >> 24);
}

template <typename C>
constexpr float kFp8Max = std::is_same_v<C, Fp8E4m3> ? 448.f : 57344.f;

// A row of D values into the cache at dst: copied for the model dtype; for fp8 x / scale saturated and rounded.
template <typename T, typename C>
inline void store_row(const T* x, C* dst, int64_t D, float scale) {
  if constexpr (kIsFp8<C>) {
    for (int64_t d = 0; d < D; ++d)
      dst[d].bits = to_fp8(std::clamp(widen(x[d]) / scale, -kFp8Max<C>, kFp8Max<C>), static_cast<C*>(nullptr));
  } else {
    std::copy(x, x + D, dst);
  }
}

}  // namespace pagedserve
