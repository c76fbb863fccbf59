// fp8 bytes (e4m3, e5m2) read as float32 or bf16, exactly: an fp8 KV cache's elements and fp8 e4m3 weights.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common.h"

namespace pagedserve {

struct Fp8E4m3 { uint8_t bits; };
struct Fp8E5m2 { uint8_t bits; };

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, Fp8E4m3> || std::is_same_v<C, Fp8E5m2>;

// The readers widen e4m3 through float16 (below), which gives the value times 2^-8: the factor they multiply back.
template <typename C>
constexpr float kFp8Unit = std::is_same_v<C, Fp8E4m3> ? 256.f : 1.f;

inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// The float16 bits of an fp8 byte: e5m2 is float16's top byte; e4m3's bits placed there (bias 7 against 15) read as
// its value times 2^-8 (kFp8Unit), subnormals included.
inline uint16_t fp8_half_bits(uint8_t b, Fp8E4m3*) { return uint16_t(((b & 0x80) << 8) | ((b & 0x7F) << 7)); }
inline uint16_t fp8_half_bits(uint8_t b, Fp8E5m2*) { return uint16_t(b << 8); }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return bits_float(sign) + (sign ? -1.f : 1.f) * std::ldexp(float(man), -24);
  return bits_float(sign | ((exp + 112) << 23) | (man << 13));  // no inf / NaN is ever stored
}

// An fp8 e4m3 weight's element as its value (int8 weights' twin in common.h: the scales apply to the sums).
inline float widen(Fp8E4m3 w) { return half_to_float(fp8_half_bits(w.bits, static_cast<Fp8E4m3*>(nullptr))) * 256.f; }

#if defined(__AVX2__) && defined(__F16C__)
// 8 fp8 bytes as their values / kFp8Unit.
template <typename C>
inline __m256 fp8_units8(const uint8_t* b) {
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  __m128i half;
  if constexpr (std::is_same_v<C, Fp8E4m3>)
    half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                        _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7));
  else
    half = _mm_slli_epi16(h, 8);
  return _mm256_cvtph_ps(half);
}
#endif

#ifdef __AVX2__
// 8 fp8 e4m3 weights as float32 lanes of their values (common.h's load8 for the other weight types).
inline __m256 load8(const Fp8E4m3* p) {
#ifdef __F16C__
  return _mm256_mul_ps(fp8_units8<Fp8E4m3>(reinterpret_cast<const uint8_t*>(p)), _mm256_set1_ps(256.f));
#else
  alignas(32) float lanes[8];
  for (int i = 0; i < 8; ++i) lanes[i] = widen(p[i]);
  return _mm256_load_ps(lanes);
#endif
}
#endif

// fp8 rows widened into buf as their values / kFp8Unit.
template <typename C>
inline const float* widen_fp8_rows(const C* src, float* buf, int64_t count) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(buf + i, fp8_units8<C>(b + i));
#endif
  for (; i < count; ++i) buf[i] = half_to_float(fp8_half_bits(b[i], static_cast<C*>(nullptr)));
  return buf;
}

// The bf16 bits of an fp8 byte without its sign (values / kFp8Unit, as widen_fp8_rows gives them; exact), by the
// byte's low 7 bits.
template <typename C>
inline const uint16_t* fp8_bf16_table() {
  alignas(64) static const std::array<uint16_t, 128> table = [] {
    std::array<uint16_t, 128> t{};
    for (int i = 0; i < 128; ++i)
      t[i] = uint16_t(float_bits(half_to_float(fp8_half_bits(uint8_t(i), static_cast<C*>(nullptr)))) >> 16);
    return t;
  }();
  return table.data();
}

// fp8_bf16_table's entries split into bytes for vpermt2b: [0, 128) the low bytes, [128, 256) the high ones; then
// byte indices (into low | high as one 128-byte table) that interleave them into words: [256, 384) words 0-31 and
// 32-63 in order; [384, 512) the V pass's pairs of two rows (fp8_bf16_pairs), as unpacklo / unpackhi_epi16 would
// pair bf16 rows u and w: word 2j + half of the first (second) from position 32 half + 8 (j / 4) + j % 4 (+ 4).
template <typename C>
inline const uint8_t* fp8_bf16_byte_tables() {
  alignas(64) static const std::array<uint8_t, 512> bytes = [] {
    std::array<uint8_t, 512> t{};
    const uint16_t* words = fp8_bf16_table<C>();
    for (int i = 0; i < 128; ++i) t[i] = uint8_t(words[i]), t[128 + i] = uint8_t(words[i] >> 8);
    for (int w = 0; w < 64; ++w) t[256 + 2 * w] = uint8_t(w), t[256 + 2 * w + 1] = uint8_t(64 + w);
    for (int m = 0; m < 2; ++m)
      for (int k = 0; k < 32; ++k) {
        const int j = k / 2, pos = 32 * (k % 2) + 8 * (j / 4) + 4 * m + j % 4;
        t[384 + 64 * m + 2 * k] = uint8_t(pos), t[384 + 64 * m + 2 * k + 1] = uint8_t(64 + pos);
      }
    return t;
  }();
  return bytes.data();
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr bool kFp8Vbmi = true;
// 64 fp8 bytes to bf16 words by vpermt2b from fp8_bf16_byte_tables: the word's low and high bytes looked up by the
// byte's low 7 bits (vpermt2b reads only those), the sign put into the high byte, the two interleaved into words by
// one of the tables' index pairs (`order`: 256 words in order, 384 the V pass's pairs).
template <typename C>
struct Fp8Bf16Lookup {
  __m512i lo0, lo1, hi0, hi1, first, second, sign = _mm512_set1_epi8(char(0x80));
  explicit Fp8Bf16Lookup(int order) {
    const uint8_t* bytes = fp8_bf16_byte_tables<C>();
    lo0 = _mm512_load_si512(bytes), lo1 = _mm512_load_si512(bytes + 64);
    hi0 = _mm512_load_si512(bytes + 128), hi1 = _mm512_load_si512(bytes + 192);
    first = _mm512_load_si512(bytes + order), second = _mm512_load_si512(bytes + order + 64);
  }
  void operator()(__m512i x, __m512i* out) const {
    const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign, 0xF8);
    out[0] = _mm512_permutex2var_epi8(lo, first, hi);
    out[1] = _mm512_permutex2var_epi8(lo, second, hi);
  }
};

// The bf16 pairs (u[d], w[d]) of 32 dims of two fp8 rows, in fp8_bf16_byte_tables' pair order (lookup of order 384).
template <typename C>
inline void fp8_bf16_pairs(const C* u, const C* w, const Fp8Bf16Lookup<C>& lookup, __m512i* out) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u));
  lookup(_mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), 1),
         out);
}
#else
constexpr bool kFp8Vbmi = false;
#endif

// fp8 rows as bf16 into buf, for the AVX-512 BF16 readers. With VBMI 64 bytes at a time (Fp8Bf16Lookup); else 32 at
// a time: a normal byte's exponent and mantissa bits moved into bf16's and its exponent rebased (bias 7 or 15, less
// log2 kFp8Unit, against 127: 112 for both kinds), a subnormal's (exponent bits 0) looked up in the table's first 32
// entries, the sign moved up. Both give fp8_bf16_table's words exactly.
template <typename C>
inline const uint16_t* bf16_fp8_rows(const C* src, uint16_t* buf, int64_t count) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(src);
  const uint16_t* table = fp8_bf16_table<C>();
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  const Fp8Bf16Lookup<C> lookup(256);
  for (; i + 64 <= count; i += 64) {
    __m512i words[2];
    lookup(_mm512_loadu_si512(b + i), words);
    _mm512_storeu_si512(buf + i, words[0]);
    _mm512_storeu_si512(buf + i + 32, words[1]);
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  constexpr bool e4m3 = std::is_same_v<C, Fp8E4m3>;
  const __m512i subnormals = _mm512_load_si512(table), low7 = _mm512_set1_epi16(0x7F);
  const __m512i rebase = _mm512_set1_epi16(112 << 7), exponent = _mm512_set1_epi16(e4m3 ? 0x78 : 0x7C);
  const __m512i sign = _mm512_set1_epi16(0x80);
  for (; i + 32 <= count; i += 32) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i)));
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(x, low7), e4m3 ? 4 : 5), rebase);
    const __m512i value = _mm512_mask_permutexvar_epi16(normal, _mm512_testn_epi16_mask(x, exponent), x, subnormals);
    _mm512_storeu_si512(buf + i, _mm512_or_si512(value, _mm512_slli_epi16(_mm512_and_si512(x, sign), 8)));
  }
#endif
  for (; i < count; ++i) buf[i] = uint16_t(table[b[i] & 0x7F] | ((b[i] & 0x80) << 8));
  return buf;
}

}  // namespace pagedserve
