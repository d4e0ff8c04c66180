// Float32 linear layer on CPU as an XLA FFI custom call: y = x @ W. Built with the other
// kernels into one library by runtime/cpu_kernels.py; runtime/cpu_matmul.py packs the
// weights and calls it from the jitted step.
//
// Why not XLA: XLA:CPU's float32 dot runs a 64-row SmolLM2 projection (64 x 576 by 576 x
// 1536) at 50-100 GFLOP/s on a 2-core EPYC whose FMA units do ~190. This is the textbook
// register tile instead: 6 rows x 16 columns of accumulators (12 ymm) over the whole K, the
// weights packed so that each k's 16 columns are one contiguous 64-byte line, the rows'
// values broadcast from memory. It is AVX2 + FMA code: on Zen 4 (512-bit ops run as two
// 256-bit halves) that is the same FLOP rate as AVX-512.
//
// Layout: x [M, K] float32; w [S, K, 16] float32 packed by runtime/cpu_matmul.py: strip s
// holds columns 16s..16s+15 (N = 16 S: the packer only takes N divisible by 16). Out [M, N].

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::run_parallel;

constexpr int64_t kCols = 16;   // output columns per packed strip (2 ymm)
constexpr int64_t kRows = 6;    // rows per register tile: 12 accumulators + 2 weights + 1 broadcast
constexpr int64_t kPanel = 48;  // rows per work item: its x rows (48 x K floats) stay in L2

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

constexpr bool kVectorized = true;

template <int R>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  // (two flat arrays, not acc[R][2]: GCC kept the 2-D one in memory, a store per FMA)
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
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

template <int R>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  float acc[R][kCols] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kCols; ++c) acc[r][c] = std::fma(x[r * K + k], w[kCols * k + c], acc[r][c]);
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + kCols, out + r * N);
}
#endif

// Rows [m0, m1) of strip s.
void panel(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t s, int64_t m0, int64_t m1) {
  const float* ws = w + s * K * kCols;
  for (int64_t m = m0; m < m1; m += kRows) {
    const float* xm = x + m * K;
    float* om = out + m * N + s * kCols;
    switch (std::min(kRows, m1 - m)) {
      case 6: tile<6>(xm, K, ws, om, N); break;
      case 5: tile<5>(xm, K, ws, om, N); break;
      case 4: tile<4>(xm, K, ws, om, N); break;
      case 3: tile<3>(xm, K, ws, om, N); break;
      case 2: tile<2>(xm, K, ws, om, N); break;
      default: tile<1>(xm, K, ws, om, N); break;
    }
  }
}

ffi::Error F32Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> out, int64_t num_threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != kCols || wd[1] != xd[1] ||
      od[0] != xd[0] || od[1] != wd[0] * kCols) {
    return ffi::Error::InvalidArgument("float32 linear: x [M,K], packed w [N/16,K,16], out [M,N] disagree");
  }
  const int64_t M = xd[0], K = xd[1], S = wd[0], N = od[1];
  if (M == 0) return ffi::Error::Success();
  const float *xs = x.typed_data(), *ws = w.typed_data();
  float* o = out->typed_data();
  const int64_t panels = (M + kPanel - 1) / kPanel;
  // Items walk the row panels of one strip before the next strip: each strip's weights come
  // from memory once per call (the head's 113 MB would otherwise stream once per panel), and
  // the panels' rows (M x K floats) are re-read from L2/L3.
  run_parallel(pool, num_threads, panels * S, [=](int64_t i) {
    const int64_t s = i / panels, pn = i % panels;
    panel(xs, ws, o, K, N, s, pn * kPanel, std::min(M, (pn + 1) * kPanel));
  });
  return ffi::Error::Success();
}

}  // namespace

// 1 when the library was compiled with AVX2 + FMA.
extern "C" int PagedjaxF32LinearVectorized() { return kVectorized ? 1 : 0; }

// 1 where the kernel serves float32 layers by default (runtime/cpu_matmul.py): AVX2 CPUs
// without AVX-512, where it was measured faster than XLA. On AVX-512 CPUs XLA's dot has
// twice the vector width to work with (Intel's two 512-bit FMA ports) and stays the default
// until measured there (PAGEDJAX_F32_KERNEL=1 turns the kernel on for that A/B).
extern "C" int PagedjaxF32LinearPreferred() {
#if defined(__AVX512F__)
  return 0;
#else
  return kVectorized ? 1 : 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxF32Linear, F32Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));
