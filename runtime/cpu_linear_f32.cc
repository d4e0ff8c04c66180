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

#include <algorithm>
#include <cstdint>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

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

// Rows [m0, m1) of strips s..s+P-1 (P = kStrips, or 1 for an odd last strip), prefetching
// `pf` (the next item's strips, or null) as it goes.
template <int P>
void panel(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t s, int64_t m0, int64_t m1,
           const float* pf) {
  const float* ws = w + s * K * kCols;
  const int64_t tiles = (m1 - m0 + kRows - 1) / kRows, lines = pf ? kStrips * K : 0;  // 16 floats a line
  Ahead ahead{reinterpret_cast<const char*>(pf), 0, K};
  for (int64_t t = 0, m = m0; m < m1; ++t, m += kRows) {
    ahead.lines = lines * (t + 1) / tiles - lines * t / tiles;
    ahead.acc = 0;
    tile_rows<P>(std::min(kRows, m1 - m), x + m * K, K, ws, out + m * N + s * kCols, N, ahead);
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
  // as few row panels as keep their x rows in L2, of even size (64 rows: one panel)
  const int64_t cap = std::max(kRows, kPanelBytes / (K * 4) / kRows * kRows);
  const int64_t panels = (M + cap - 1) / cap, groups = (S + kStrips - 1) / kStrips;
  const int64_t kPanel = ((M + panels - 1) / panels + kRows - 1) / kRows * kRows;
  // Items walk the row panels of one strip group before the next: each strip's weights come
  // from memory once per call (the head's 113 MB would otherwise stream once per panel), and
  // the panels' rows (M x K floats) are re-read from L2/L3.
  run_parallel_ahead(pool, num_threads, panels * groups, [=](int64_t i, int64_t next) {
    const int64_t s = (i / panels) * kStrips, m0 = (i % panels) * kPanel, m1 = std::min(M, m0 + kPanel);
    const int64_t sn = next < 0 ? s : (next / panels) * kStrips;  // (the same strips: cached already)
    const float* pf = sn == s ? nullptr : ws + sn * K * kCols;
    if (S - s >= kStrips) {
      panel<kStrips>(xs, ws, o, K, N, s, m0, m1, pf);
    } else {
      panel<1>(xs, ws, o, K, N, s, m0, m1, pf);
    }
  });
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
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));
