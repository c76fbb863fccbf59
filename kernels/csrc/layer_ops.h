// The elementwise pieces of a decoder layer, one row at a time, each with the roundings to the model dtype that the
// families' torch ops make: the norms (RMSNorm, Gemma's (1 + w) RMSNorm, LayerNorm), the MLP activations, rotary.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedserve {

// A layer's norm kind (its family's, the final norm's too) and its activation: DecoderLayer's dims carry them.
enum NormKind : int64_t { kRmsNorm = 0, kGemmaRmsNorm = 1, kLayerNorm = 2 };
enum Activation : int64_t { kSiluGlu = 0, kGeluTanhGlu = 1, kGelu = 2, kGeluTanh = 3, kRelu = 4 };

// The elementwise steps between the products go over the threads from this many elements on: below it, waking
// them costs more than the work (a few microseconds a region; a layer has several).
constexpr int64_t kParallelMinElements = 1 << 14;

inline bool gated(int64_t activation) { return activation == kSiluGlu || activation == kGeluTanhGlu; }

// One norm: a null weight is no norm at all; bias only for LayerNorm (null: none).
template <typename T>
struct Norm {
  int64_t kind = kRmsNorm;
  const T* weight = nullptr;
  const T* bias = nullptr;
  float eps = 0.f;
};

template <typename T>
inline T round_to(float x) {
  T out;
  store(x, &out);
  return out;
}

// sum(x^2) of a row in float32: in 16 lanes (torch's own reduction is vectorized too: neither sums in index order).
template <typename T>
float sum_squares(const T* x, int64_t dim) {
  float sq = 0.f;
  int64_t d = 0;
#ifdef __AVX2__
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (; d + 16 <= dim; d += 16) {
    const __m256 a = load8(x + d), b = load8(x + d + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  for (; d + 8 <= dim; d += 8) even = _mm256_fmadd_ps(load8(x + d), load8(x + d), even);
  sq = hsum(_mm256_add_ps(even, odd));
#endif
  for (; d < dim; ++d) sq += widen(x[d]) * widen(x[d]);
  return sq;
}

// out = weight * round(x * rsqrt(mean(x^2) + eps)) for one row, statistics in float32 (HF's RMSNorm).
template <typename T>
void rms_norm_row(const T* x, const T* weight, float eps, T* out, int64_t dim) {
  const float r = 1.f / std::sqrt(sum_squares(x, dim) / float(dim) + eps);
  int64_t d = 0;
#ifdef __AVX2__
  for (const __m256 rv = _mm256_set1_ps(r); d + 8 <= dim; d += 8)
    store8(_mm256_mul_ps(load8(weight + d), round8<T>(_mm256_mul_ps(load8(x + d), rv))), out + d);
#endif
  for (; d < dim; ++d) store(widen(weight[d]) * widen(round_to<T>(widen(x[d]) * r)), out + d);
}

// Gemma's: out = round(x * rsqrt(mean(x^2) + eps) * (1 + weight)), all in float32.
template <typename T>
void gemma_norm_row(const T* x, const T* weight, float eps, T* out, int64_t dim) {
  const float r = 1.f / std::sqrt(sum_squares(x, dim) / float(dim) + eps);
  int64_t d = 0;
#ifdef __AVX2__
  for (const __m256 rv = _mm256_set1_ps(r), one = _mm256_set1_ps(1.f); d + 8 <= dim; d += 8)
    store8(_mm256_mul_ps(_mm256_mul_ps(load8(x + d), rv), _mm256_add_ps(one, load8(weight + d))), out + d);
#endif
  for (; d < dim; ++d) store(widen(x[d]) * r * (1.f + widen(weight[d])), out + d);
}

// LayerNorm: out = round((x - mean) * rsqrt(var + eps) * weight + bias), mean and (biased) variance in float32.
template <typename T>
void layer_norm_row(const T* x, const T* weight, const T* bias, float eps, T* out, int64_t dim) {
  float sum = 0.f, sq = 0.f;
  int64_t d = 0;
#ifdef __AVX2__
  __m256 lanes = _mm256_setzero_ps();
  for (; d + 8 <= dim; d += 8) lanes = _mm256_add_ps(lanes, load8(x + d));
  sum = hsum(lanes);
#endif
  for (; d < dim; ++d) sum += widen(x[d]);
  const float mean = sum / float(dim);
  d = 0;
#ifdef __AVX2__
  lanes = _mm256_setzero_ps();
  for (const __m256 m = _mm256_set1_ps(mean); d + 8 <= dim; d += 8) {
    const __m256 c = _mm256_sub_ps(load8(x + d), m);
    lanes = _mm256_fmadd_ps(c, c, lanes);
  }
  sq = hsum(lanes);
#endif
  for (; d < dim; ++d) sq += (widen(x[d]) - mean) * (widen(x[d]) - mean);
  const float r = 1.f / std::sqrt(sq / float(dim) + eps);
  d = 0;
#ifdef __AVX2__
  for (const __m256 m = _mm256_set1_ps(mean), rv = _mm256_set1_ps(r); d + 8 <= dim; d += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_sub_ps(load8(x + d), m), rv), load8(weight + d));
    store8(bias ? _mm256_add_ps(y, load8(bias + d)) : y, out + d);
  }
#endif
  for (; d < dim; ++d)
    store((widen(x[d]) - mean) * r * widen(weight[d]) + (bias ? widen(bias[d]) : 0.f), out + d);
}

template <typename T>
void norm_row(const Norm<T>& norm, const T* x, T* out, int64_t dim) {
  if (norm.kind == kGemmaRmsNorm) return gemma_norm_row(x, norm.weight, norm.eps, out, dim);
  if (norm.kind == kLayerNorm) return layer_norm_row(x, norm.weight, norm.bias, norm.eps, out, dim);
  rms_norm_row(x, norm.weight, norm.eps, out, dim);
}

// residual_out = round(x + residual) (x alone without a residual), then out = its norm; one row.
template <typename T>
void add_and_norm_row(const T* x, const T* residual, const Norm<T>& norm, T* residual_out, T* out, int64_t dim) {
  int64_t d = 0;
#ifdef __AVX2__
  for (; residual && d + 8 <= dim; d += 8) store8(_mm256_add_ps(load8(x + d), load8(residual + d)), residual_out + d);
#endif
  for (; d < dim; ++d) residual_out[d] = residual ? round_to<T>(widen(x[d]) + widen(residual[d])) : x[d];
  norm_row(norm, residual_out, out, dim);
}

// x(g) of one activation, as torch computes it in float32 (GELU's erf within ~1e-7 of it: Abramowitz and Stegun
// 7.1.26, its 1 + erf(z) taken as 2 - erfc or erfc so that neither side cancels).
inline float activate(int64_t activation, float g) {
  switch (activation) {
    case kGelu: {
      const float z = std::fabs(g) * 0.70710678118654752f, t = 1.f / (1.f + 0.3275911f * z);
      const float erfc = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f +
                         t * 1.061405429f)))) * std::exp(-z * z);
      return 0.5f * g * (g >= 0.f ? 2.f - erfc : erfc);
    }
    case kGeluTanh:
    case kGeluTanhGlu:  // 0.5 (1 + tanh(y)) = sigmoid(2y)
      return g / (1.f + std::exp(-2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g)));
    case kRelu:
      return g > 0.f ? g : 0.f;
    default:
      return g / (1.f + std::exp(-g));
  }
}

#ifdef __AVX2__
// activate() of 8 lanes, by the same formulas (e^x by exp8).
inline __m256 activate8(int64_t activation, __m256 g) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  switch (activation) {
    case kGelu: {
      const __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), g), _mm256_set1_ps(0.70710678118654752f));
      const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), z, one));
      __m256 poly = _mm256_set1_ps(1.061405429f);
      for (const float c : {-1.453152027f, 1.421413741f, -0.284496736f, 0.254829592f})
        poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(c));
      const __m256 erfc = _mm256_mul_ps(_mm256_mul_ps(poly, t), exp8(_mm256_sub_ps(zero, _mm256_mul_ps(z, z))));
      const __m256 positive = _mm256_cmp_ps(g, zero, _CMP_GE_OQ);
      const __m256 sum = _mm256_blendv_ps(erfc, _mm256_sub_ps(_mm256_set1_ps(2.f), erfc), positive);
      return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), sum);
    }
    case kGeluTanh:
    case kGeluTanhGlu: {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      const __m256 y = _mm256_mul_ps(_mm256_set1_ps(-2.f * 0.7978845608028654f),
                                     _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), cube, g));
      return _mm256_div_ps(g, _mm256_add_ps(one, exp8(y)));
    }
    case kRelu:
      return _mm256_max_ps(g, zero);
    default:
      return _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
  }
}
#endif

// act = round(round(silu(gate)) * up) for one row of [gate | up], silu(g) = g / (1 + e^-g) as torch computes it.
template <typename T>
void silu_and_mul_row(const T* gate_up, T* act, int64_t I) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; i + 16 <= I; i += 16) {
    const __m512 g = load16(gate_up + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
    store16(_mm512_mul_ps(silu, load16(gate_up + I + i)), act + i);
  }
#endif
#ifdef __AVX2__
  for (; i + 8 <= I; i += 8) {
    const __m256 g = load8(gate_up + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 silu = round8<T>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store8(_mm256_mul_ps(silu, load8(gate_up + I + i)), act + i);
  }
#endif
  for (; i < I; ++i)
    act[i] = round_to<T>(widen(round_to<T>(activate(kSiluGlu, widen(gate_up[i])))) * widen(gate_up[I + i]));
}

// One row's activation: [gate | up] of 2I into act [I] for a gated one (round(round(f(gate)) * up)), else
// act = round(f(h)) of h [I].
template <typename T>
void activate_row(int64_t activation, const T* h, T* act, int64_t I) {
  if (activation == kSiluGlu) return silu_and_mul_row(h, act, I);
  int64_t i = 0;
  if (gated(activation)) {
#ifdef __AVX2__
    for (; i + 8 <= I; i += 8)
      store8(_mm256_mul_ps(round8<T>(activate8(activation, load8(h + i))), load8(h + I + i)), act + i);
#endif
    for (; i < I; ++i)
      act[i] = round_to<T>(widen(round_to<T>(activate(activation, widen(h[i])))) * widen(h[I + i]));
    return;
  }
#ifdef __AVX2__
  for (; i + 8 <= I; i += 8) store8(activate8(activation, load8(h + i)), act + i);
#endif
  for (; i < I; ++i) store(activate(activation, widen(h[i])), act + i);
}

// Rotate-half rotary embedding of the first `dim` values of one head in place (cos and sin [dim]), each product and
// the sum rounded as torch's ops do.
template <typename T>
void rotate(T* x, int64_t dim, const float* cos, const float* sin) {
  const int64_t half = dim / 2;
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 8 <= half; d += 8) {
    const __m256 a = load8(x + d), b = load8(x + d + half);
    const __m256 c0 = round8<T>(_mm256_loadu_ps(cos + d)), s0 = round8<T>(_mm256_loadu_ps(sin + d));
    const __m256 c1 = round8<T>(_mm256_loadu_ps(cos + d + half)), s1 = round8<T>(_mm256_loadu_ps(sin + d + half));
    const __m256 minus_b = _mm256_sub_ps(_mm256_setzero_ps(), b);
    store8(_mm256_add_ps(round8<T>(_mm256_mul_ps(a, c0)), round8<T>(_mm256_mul_ps(minus_b, s0))), x + d);
    store8(_mm256_add_ps(round8<T>(_mm256_mul_ps(b, c1)), round8<T>(_mm256_mul_ps(a, s1))), x + d + half);
  }
#endif
  for (; d < half; ++d) {
    const float a = widen(x[d]), b = widen(x[d + half]);
    const float c0 = widen(round_to<T>(cos[d])), s0 = widen(round_to<T>(sin[d]));
    const float c1 = widen(round_to<T>(cos[d + half])), s1 = widen(round_to<T>(sin[d + half]));
    store(widen(round_to<T>(a * c0)) + widen(round_to<T>(-b * s0)), x + d);
    store(widen(round_to<T>(b * c1)) + widen(round_to<T>(a * s1)), x + d + half);
  }
}

}  // namespace pagedserve
