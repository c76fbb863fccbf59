// Helpers every CPU kernel shares: bf16 <-> float32 as torch converts them.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#ifdef __AVX2__
#include <immintrin.h>
#endif

// For the per-column-pair conversions of a product's innermost loop: past some number of instantiations calling one
// (a functor for each row count) GCC calls it out of line, once per column pair.
#define PAGEDSERVE_ALWAYS_INLINE __attribute__((always_inline))

namespace pagedserve {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { uint32_t u = uint32_t(x) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float widen(int8_t x) { return float(x); }  // int8 weights; their per-row scale is applied to the sum
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &x, 4);
  *dst = std::isnan(x) ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __AVX2__
// 8 elements as float32 lanes: bf16 widened, int8 converted.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// 8 lanes rounded to bf16 as store() rounds each, kept as float32 (widen(round_to<uint16_t>(x)) lane by lane);
// float32 lanes stay as they are.
inline __m256 round_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                     _mm256_set1_epi32(int32_t(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                          _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
template <typename T>
inline __m256 round8(__m256 x) {
  if constexpr (sizeof(T) == 2) return round_bf16_8(x);
  return x;
}

// 8 lanes stored as store() stores each.
inline void store8(__m256 x, float* dst) { _mm256_storeu_ps(dst, x); }
inline void store8(__m256 x, uint16_t* dst) {
  const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(x)), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Cephes' e^x for float32 lanes (exp8, exp16): clamp, n = round(x / ln 2), x - n ln 2 in two parts, a degree-5
// polynomial, times 2^n.
constexpr float kExpLow = -87.3365f, kExpHigh = 88.3762f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                              1.6666665459e-1f, 5.0000001201e-1f};

// e^x of 8 lanes: within 2 ulp of std::exp, 0 below -87.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLow);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), x);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The 16-lane twins of load8, round8, store8 and exp8: the same operations in the same order, so the same values.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 round_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(int32_t(0xffff0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_castsi512_ps(r),
                              _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (sizeof(T) == 2) return round_bf16_16(x);
  return x;
}
inline void store16(__m512 x, float* dst) { _mm512_storeu_ps(dst, x); }
inline void store16(__m512 x, uint16_t* dst) {
  const __m512i r = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}
inline __m256 upper8(__m512 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLow);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(_knot_mask16(underflow), y, _mm512_castsi512_ps(pow2n));
}
#endif

// Cephes' tanhf for 8 float32 lanes (within 2 ulp of std::tanh): x + x^3 P(x^2) below |x| = 0.625, else
// 1 - 2 / (e^2|x| + 1) with x's sign; NaN stays NaN. No 16-lane twin: the soft caps it serves are a
// small part of a step.
constexpr float kTanhPoly[] = {-5.70498872745e-3f, 2.06390887954e-2f, -5.37397155531e-2f, 1.33314422036e-1f,
                               -3.33332819422e-1f};
constexpr float kTanhSmall = 0.625f;
#ifdef __AVX2__
inline __m256 tanh8(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f), ax = _mm256_andnot_ps(sign, x);
  const __m256 e = exp8(_mm256_add_ps(ax, ax));
  const __m256 far = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(kTanhPoly[0]);
  for (int i = 1; i < 5; ++i) p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kTanhPoly[i]));
  const __m256 near = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 y = _mm256_blendv_ps(near, _mm256_or_ps(far, _mm256_and_ps(sign, x)),
                                    _mm256_cmp_ps(ax, _mm256_set1_ps(kTanhSmall), _CMP_GE_OQ));
  return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

// s[i] = cap * tanh(s[i] / cap) for n scores (Gemma 2's soft cap on attention scores and logits), in float32 as
// torch computes it; the last few lanes through a padded vector, so that a score's value does not depend on where it
// sits. std::tanh without AVX2.
inline void soft_cap_scores(float* s, int64_t n, float cap) {
  int64_t i = 0;
#ifdef __AVX2__
  const __m256 c = _mm256_set1_ps(cap);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(s + i), c)), c));
  if (i < n) {
    alignas(32) float tail[8] = {};
    std::memcpy(tail, s + i, (n - i) * sizeof(float));
    _mm256_store_ps(tail, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_load_ps(tail), c)), c));
    std::memcpy(s + i, tail, (n - i) * sizeof(float));
  }
#else
  for (; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
#endif
}

// *std::max_element(s, s + n) for n > 0 scores, 8 lanes at a time: a scalar running max waits on each comparison in
// turn (a tenth of a verification step's attention at 400 positions). The same value for every input: NaN only where
// s[0] is (a NaN after it is skipped, as `top < NaN` is false; maxps keeps its second operand, the running max, when
// either is NaN).
inline float max_of(const float* s, int64_t n) {
  int64_t i = 0;
  float top = s[0];
#ifdef __AVX2__
  if (n >= 32) {
    const __m256 first = _mm256_set1_ps(s[0]);
    __m256 m[4] = {first, first, first, first};
    for (; i + 32 <= n; i += 32)
      for (int j = 0; j < 4; ++j) m[j] = _mm256_max_ps(_mm256_loadu_ps(s + i + 8 * j), m[j]);
    alignas(32) float lanes[32];
    for (int j = 0; j < 4; ++j) _mm256_store_ps(lanes + 8 * j, m[j]);
    for (float lane : lanes) top = top < lane ? lane : top;
  }
#endif
  for (; i < n; ++i) top = top < s[i] ? s[i] : top;
  return top;
}

// s[i] = e^(s[i] - max) for n scores; returns their sum.
inline float exp_sum(float* s, int64_t n, float max) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (const __m512 m16 = _mm512_set1_ps(max); i + 16 <= n; i += 16) {  // the 8-lane loop's sums, in its order
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m16));
    _mm512_storeu_ps(s + i, e);
    acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(e)), upper8(e));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) sum += (s[i] = std::exp(s[i] - max));
  return sum;
}

#ifdef __AVX512F__
// Lane i of the result: the sum of a[i]'s 16 lanes (a transposed tree: 15 adds for 16 sums, where one
// _mm512_reduce_add_ps per sum takes 4).
inline __m512 sum_lanes_16(const __m512* a) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(pairs[2 * i]), hi = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xdd));
}
#endif

// Scratch rows a layer writes before it reads them, left uninitialized: a std::vector zeroes each, which took a few
// percent of a batch-32 step once per buffer per layer.
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() const { return data_.get(); }
  T& operator[](int64_t i) const { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

}  // namespace pagedserve
