// exp without libm for the CPU kernels (cpu_attention.cc's softmax, cpu_linear_f32.cc's
// SwiGLU epilogue): plain float arithmetic that GCC vectorizes, where a libm call per element
// would not.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedjax {

// 2^f for f in [0, 1): degree-6 polynomial, highest power first (fast_exp, exp16, exp8).
constexpr float kExpPoly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

// exp(x) for x in [-87, 87] (clamped below; callers clamp above where they must): 2^(x log2 e)
// with a degree-6 polynomial on the fraction; relative error ~2e-7.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExpPoly[i];
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(fi) << 23;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes, x clamped to [-87, 87].
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(fi), 23)));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// fast_exp on 8 lanes, x clamped to [-87, 87].
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 fi = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, fi);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpPoly[i]));
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(fi), 23)));
}
#endif

}  // namespace pagedjax
