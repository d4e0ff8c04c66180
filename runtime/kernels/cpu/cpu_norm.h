// The RMS norm the float and the weight-only quantized kernels apply before their product
// (cpu_linear_f32.cc, cpu_linear_wq.cc): the families' rms_norm (runtime/model/linear.py).
#pragma once
#include <cmath>
#include <cstdint>

namespace pagedjax {

// x's M rows of K RMS-normalized and scaled by `w` into `y`.
inline void rms_norm(const float* x, const float* w, float eps, int64_t M, int64_t K, float* y) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t k = 0; k < K; ++k) ss += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
    float* yr = y + r * K;
#pragma omp simd
    for (int64_t k = 0; k < K; ++k) yr[k] = xr[k] * inv * w[k];
  }
}

}  // namespace pagedjax
