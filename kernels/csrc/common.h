// Helpers every CPU kernel shares: bf16 <-> float32 as torch converts them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedserve {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float widen(int8_t x) { return float(x); }  // int8 weights; their per-row scale is applied to the sum
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &x, 4);
  *dst = std::isnan(x) ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace pagedserve
