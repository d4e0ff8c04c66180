// Float32 linear layer on CPU as an XLA FFI custom call: y = x @ W. Built with the other
// kernels into one library by runtime/cpu_kernels.py; runtime/cpu_matmul.py packs the
// weights and calls it from the jitted step.
//
// Why not XLA: XLA:CPU's float32 dot runs a 64-row SmolLM2 projection (64 x 576 by 576 x
// 1536) at 50-150 GFLOP/s on the 2-core machines here, well under their FMA peak. This is
// the textbook register tile instead: rows x 16-column strips of accumulators over the whole
// K, the weights packed so that each k's 16 columns are one contiguous 64-byte line, the
// rows' values broadcast from memory. Two builds of the same loop: AVX-512 (12 rows x 2
// strips) and AVX2 + FMA (6 rows x 1 strip); each output is the same k-ordered FMA chain, so
// both give the same bits.
//
// Layout: x [M, K] float32; w [S, K, 16] float32 packed by runtime/cpu_matmul.py: strip s
// holds columns 16s..16s+15 (N = 16 S: the packer only takes N divisible by 16). Out [M, N].
//
// Prologue: `norm` [K] (or empty) RMS-normalizes x first, x_r * rsqrt(mean(x_r^2) + eps) * norm
// (the decoder's pre-attention and pre-MLP norms), once per call on the calling thread.
//
// Epilogues, applied to each tile while it is in L1 (each saves XLA a pass over the output and
// an op launch per layer): `residual` [M, N] (or empty) is added: out = residual + x W, the
// decoder's skip connection; `swiglu` = 1: the strips come in (gate, up) pairs over the same
// 16 columns (cpu_matmul.pack_swiglu) and out [M, N / 2] = silu(gate) * up.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_exp.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::fast_exp;
using pagedjax::run_parallel_ahead;

constexpr int64_t kCols = 16;   // output columns per packed strip (one zmm, two ymm)
constexpr int64_t kPanelBytes = 512 << 10;  // a work item's x rows (rows x K floats) stay in L2

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

#endif

// The next item's weights, prefetched into L2 a few lines per k step, spread evenly over all
// of this item's tiles. Why: an item's first tile consumes 128 bytes of weights per 12
// cycles, ~30 GB/s per core, which DRAM does not deliver: with cold weights each item
// stalled at its start (SmolLM2's 30 layers of products at 64 rows: 76 ms against 52 ms
// with the same weights hot). Spread thin, the next item's read hides under this one's FMAs.
struct Ahead {
  const char* p = nullptr;  // next line to prefetch
  int64_t lines = 0;        // lines this tile prefetches over its K steps
  int64_t K = 1, acc = 0;
  inline void step() {
#if defined(__AVX2__) || defined(__AVX512F__)
    for (acc += lines; acc >= K; acc -= K, p += 64) _mm_prefetch(p, _MM_HINT_T1);
#endif
  }
};

#if defined(__AVX512F__)

// AVX-512: 12 rows x 2 strips (32 columns) of accumulators = 24 zmm, + 2 weights + 1
// broadcast of the 32 registers. Per k: 24 FMAs against 14 loads, so the two FMA ports, not
// the two load ports, set the pace (a 1-strip tile would need a broadcast per FMA).
constexpr bool kVectorized = true;
constexpr int64_t kRows = 12;
constexpr int64_t kStrips = 2;

template <int R, int P>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N, Ahead& pf) {
  const float* w1 = w + K * kCols;  // the next strip (read only when P == 2)
  __m512 a0[R], a1[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const __m512 v0 = _mm512_loadu_ps(w + kCols * k);
    const __m512 v1 = P == 2 ? _mm512_loadu_ps(w1 + kCols * k) : v0;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(xb, v0, a0[r]);
      if constexpr (P == 2) a1[r] = _mm512_fmadd_ps(xb, v1, a1[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N, a0[r]);
    if constexpr (P == 2) _mm512_storeu_ps(out + r * N + kCols, a1[r]);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)

// AVX2: 6 rows x 1 strip = 12 ymm accumulators + 2 weights + 1 broadcast of the 16.
constexpr bool kVectorized = true;
constexpr int64_t kRows = 6;
constexpr int64_t kStrips = 1;

template <int R, int P>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N, Ahead& pf) {
  static_assert(P == 1);
  // (two flat arrays, not acc[R][2]: GCC kept the 2-D one in memory, a store per FMA)
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const __m256 w0 = _mm256_load_ps(w + kCols * k), w1 = _mm256_load_ps(w + kCols * k + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * N, a0[r]);
    _mm256_storeu_ps(out + r * N + 8, a1[r]);
  }
}
#else  // no AVX2: the same numbers (sums in the same order), one multiply at a time
constexpr bool kVectorized = false;
constexpr int64_t kRows = 6;
constexpr int64_t kStrips = 1;

template <int R, int P>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N, Ahead&) {
  static_assert(P == 1);
  float acc[R][kCols] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = std::fma(x[r * K + k], w[kCols * k + c], acc[r][c]);
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + kCols, out + r * N);
}
#endif

// One tile of `rows` (1..kRows) rows over P strips: the row count picks the instantiation.
template <int P, int R = kRows>
inline void tile_rows(int64_t rows, const float* x, int64_t K, const float* w, float* out, int64_t N,
                      Ahead& pf) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<P, R - 1>(rows, x, K, w, out, N, pf);
  }
  tile<R, P>(x, K, w, out, N, pf);
}

// What a tile's products go through on their way to `out` (see the top of the file).
struct Epilogue {
  const float* residual = nullptr;  // [M, N_out], or null
  bool swiglu = false;
  bool any() const { return residual != nullptr || swiglu; }
};

// out[c] = silu(g[c]) * g[16 + c] = g u / (1 + exp(-g)) for one row's 16 columns (exp's
// argument clamped to [-87, 87]: the product is 0 or g u there to float precision).
inline void silu_mul_row(const float* g, float* out) {
#if defined(__AVX512F__)
  const __m512 gv = _mm512_loadu_ps(g), uv = _mm512_loadu_ps(g + kCols);
  const __m512 e = pagedjax::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
  _mm512_storeu_ps(out, _mm512_div_ps(_mm512_mul_ps(gv, uv), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (int h = 0; h < kCols; h += 8) {
    const __m256 gv = _mm256_loadu_ps(g + h), uv = _mm256_loadu_ps(g + kCols + h);
    const __m256 e = pagedjax::exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(out + h, _mm256_div_ps(_mm256_mul_ps(gv, uv), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
  }
#else
  for (int64_t c = 0; c < kCols; ++c) out[c] = g[c] * g[kCols + c] / (1.0f + fast_exp(std::min(-g[c], 87.0f)));
#endif
}

// Rows [m0, m1) of the item's strips s..s+ns-1 (ns = kStrips, 1 for an odd last strip, or a
// (gate, up) pair under swiglu), prefetching `pf` (the next item's strips, or null) as it goes.
// Without an epilogue a tile stores straight into `out`; with one it stores into `buf` and
// the epilogue writes `out` (N_out columns, the item's first at `col`).
void panel(const float* x, const float* w, float* out, int64_t K, int64_t N_out, int64_t s, int64_t ns,
           int64_t m0, int64_t m1, const float* pf, int64_t pf_strips, const Epilogue& epi) {
  const int64_t calls_per_tile = (ns + kStrips - 1) / kStrips;
  const int64_t calls = (m1 - m0 + kRows - 1) / kRows * calls_per_tile, lines = pf ? pf_strips * K : 0;
  const int64_t col = epi.swiglu ? s / 2 * kCols : s * kCols, width = ns * kCols;
  Ahead ahead{reinterpret_cast<const char*>(pf), 0, K};
  alignas(64) float buf[kRows * 2 * kCols];
  for (int64_t t = 0, m = m0; m < m1; m += kRows) {
    const int64_t rows = std::min(kRows, m1 - m);
    for (int64_t ss = 0; ss < ns; ss += kStrips, ++t) {
      ahead.lines = lines * (t + 1) / calls - lines * t / calls;
      ahead.acc = 0;
      const float* ws = w + (s + ss) * K * kCols;
      float* o = epi.any() ? buf + ss * kCols : out + m * N_out + col + ss * kCols;
      const int64_t stride = epi.any() ? width : N_out;
      if (ns - ss >= kStrips) {
        tile_rows<kStrips>(rows, x + m * K, K, ws, o, stride, ahead);
      } else {
        tile_rows<1>(rows, x + m * K, K, ws, o, stride, ahead);
      }
    }
    if (epi.swiglu) {
      for (int64_t r = 0; r < rows; ++r) silu_mul_row(buf + r * width, out + (m + r) * N_out + col);
    } else if (epi.residual) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* res = epi.residual + (m + r) * N_out + col;
        float* o = out + (m + r) * N_out + col;
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) o[c] = buf[r * width + c] + res[c];
      }
    }
  }
}

// x's rows RMS-normalized and scaled by `w` into `y` (as runtime/models/llama.py rms_norm).
void rms_norm(const float* x, const float* w, float eps, int64_t M, int64_t K, float* y) {
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

ffi::Error F32Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> norm, ffi::ResultBuffer<ffi::F32> out,
                     int64_t num_threads, int64_t swiglu, float eps) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != kCols || wd[1] != xd[1] ||
      od[0] != xd[0] || od[1] * (swiglu ? 2 : 1) != wd[0] * kCols || (swiglu && wd[0] % 2)) {
    return ffi::Error::InvalidArgument(
        "float32 linear: x [M,K], packed w [N/16,K,16], out [M,N] (swiglu: [M,N/2], strips in pairs) disagree");
  }
  const int64_t M = xd[0], K = xd[1], S = wd[0], N_out = od[1];
  if (residual.element_count() != 0 && (swiglu || residual.element_count() != static_cast<size_t>(M * N_out))) {
    return ffi::Error::InvalidArgument("float32 linear: the residual must be [M, N] (and not with swiglu)");
  }
  if (norm.element_count() != 0 && norm.element_count() != static_cast<size_t>(K)) {
    return ffi::Error::InvalidArgument("float32 linear: the norm weight must have K elements");
  }
  if (M == 0) return ffi::Error::Success();
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* o = out->typed_data();
  thread_local std::vector<float> normed;  // (the items read it before this call returns)
  std::function<void()> prologue;
  if (norm.element_count() != 0) {
    normed.resize(M * K);
    prologue = [x = xs, nw = norm.typed_data(), eps, M, K, y = normed.data()] { rms_norm(x, nw, eps, M, K, y); };
    xs = normed.data();
  }
  const Epilogue epi{residual.element_count() ? residual.typed_data() : nullptr, swiglu != 0};
  // as few row panels as keep their x rows in L2, of even size (64 rows: one panel)
  const int64_t cap = std::max(kRows, kPanelBytes / (K * 4) / kRows * kRows);
  const int64_t gs = swiglu ? 2 : kStrips;  // strips per item
  const int64_t panels = (M + cap - 1) / cap, groups = (S + gs - 1) / gs;
  const int64_t kPanel = ((M + panels - 1) / panels + kRows - 1) / kRows * kRows;
  // Items walk the row panels of one strip group before the next: each strip's weights come
  // from memory once per call (the head's 113 MB would otherwise stream once per panel), and
  // the panels' rows (M x K floats) are re-read from L2/L3.
  run_parallel_ahead(pool, num_threads, panels * groups, [=](int64_t i, int64_t next) {
    const int64_t s = (i / panels) * gs, m0 = (i % panels) * kPanel, m1 = std::min(M, m0 + kPanel);
    const int64_t sn = next < 0 ? s : (next / panels) * gs;  // (the same strips: cached already)
    const float* pf = sn == s ? nullptr : ws + sn * K * kCols;
    panel(xs, ws, o, K, N_out, s, std::min(gs, S - s), m0, m1, pf, std::min(gs, S - sn), epi);
  }, prologue);
  return ffi::Error::Success();
}

}  // namespace

// 1 when the library was compiled with AVX2 + FMA.
extern "C" int PagedjaxF32LinearVectorized() { return kVectorized ? 1 : 0; }

// 1 where the kernel serves float32 layers by default (runtime/cpu_matmul.py): wherever it
// is vectorized. Measured faster than XLA's dot at 1-512 rows with the AVX2 tile on a Zen 3
// EPYC and with the AVX-512 tile on an Ice Lake Xeon (BENCHMARKS.md); Zen 4 (AVX-512 on
// 256-bit units) was not measured. PAGEDJAX_F32_KERNEL=0 gives XLA's dot for an A/B.
extern "C" int PagedjaxF32LinearPreferred() { return kVectorized ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxF32Linear, F32Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads")
                                  .Attr<int64_t>("swiglu")
                                  .Attr<float>("eps"));
