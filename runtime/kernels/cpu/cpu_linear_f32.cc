// Float32 linear layer on CPU as an XLA FFI custom call: y = x @ W. Built with the other
// kernels into one library by runtime/kernels/cpu/build.py; runtime/kernels/cpu/matmul.py packs the
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
// Layout: x [M, K] float32; w [S, K, 16] float32 packed by runtime/kernels/cpu/matmul.py: strip s
// holds columns 16s..16s+15 (N = 16 S: the packer only takes N divisible by 16). Out [M, N].
//
// Prologue: `norm` [K] (or empty) RMS-normalizes x first, x_r * rsqrt(mean(x_r^2) + eps) * norm
// (the decoder's pre-attention and pre-MLP norms), once per call on the calling thread.
//
// Epilogues, applied to each tile while it is in L1 (each saves XLA a pass over the output and
// an op launch per layer): `residual` [M, N] (or empty) is added: out = residual + x W, the
// decoder's skip connection; `swiglu` = 1: the strips come in (gate, up) pairs over the same
// 16 columns (cpu_matmul.pack_swiglu) and out [M, N / 2] = silu(gate) * up.
//
// A second target, the layer tail (F32LayerTail), runs a decoder layer's products after
// attention (wo, the MLP, the next layer's q|k|v) as the dependent phases of one call.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_exp.h"
#include "cpu_norm.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::fast_exp;
using pagedjax::rms_norm;

constexpr int64_t kCols = 16;   // output columns per packed strip (one zmm, two ymm)
constexpr int64_t kPanelBytes = 512 << 10;  // a work item's x rows (rows x K floats) stay in L2
// Items of fewer rows leave the next item's weights to the hardware prefetchers: a 1-row item
// is over before its prefetches land, and they only took load slots (SmolLM2's 1-row step,
// 2-core AMX Xeon: 1.8 ms faster without; from 4 rows the prefetch pays).
constexpr int64_t kPrefetchMinRows = 4;

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

// One row over P strips (P = kWide at a 1-row item): P independent FMA chains, where a 1-row
// tile would have one (AVX2: two) per strip. Why: a 1-row product only streams weights, and
// each strip's chain waits on its last FMA's latency, which bounded how fast a thread
// catches up once its stalled loads arrive (4 chains read ~4% faster than 2 in a C++ loop
// over SmolLM2-sized items on the AMX Xeon). Each output is still its k-ordered chain: the
// same bits as in a tile of any row count.
constexpr int64_t kWide = 4;

template <int P>
inline void row_strips(const float* x, int64_t K, const float* w, float* out, Ahead& pf) {
#if defined(__AVX512F__)
  __m512 a[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) a[p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const __m512 xb = _mm512_set1_ps(x[k]);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) a[p] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(w + p * K * kCols + kCols * k), a[p]);
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) _mm512_storeu_ps(out + p * kCols, a[p]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[2 * P];
#pragma GCC unroll 8
  for (int p = 0; p < 2 * P; ++p) a[p] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    pf.step();
    const __m256 xb = _mm256_broadcast_ss(x + k);
#pragma GCC unroll 8
    for (int p = 0; p < 2 * P; ++p)
      a[p] = _mm256_fmadd_ps(xb, _mm256_load_ps(w + (p / 2) * K * kCols + kCols * k + 8 * (p % 2)), a[p]);
  }
#pragma GCC unroll 8
  for (int p = 0; p < 2 * P; ++p) _mm256_storeu_ps(out + (p / 2) * kCols + 8 * (p % 2), a[p]);
#else
  for (int p = 0; p < P; ++p) tile<1, 1>(x, K, w + p * K * kCols, out + p * kCols, 0, pf);
#endif
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
// (gate, up) pair under swiglu), prefetching `pf_lines` 64-byte lines from `pf` (the next
// item's strips, or null) as it goes.
// Without an epilogue a tile stores straight into `out`; with one it stores into `buf` and
// the epilogue writes `out` (N_out columns, the item's first at `col`).
void panel(const float* x, const float* w, float* out, int64_t K, int64_t N_out, int64_t s, int64_t ns,
           int64_t m0, int64_t m1, const float* pf, int64_t pf_lines, const Epilogue& epi) {
  const int64_t calls_per_tile = (ns + kStrips - 1) / kStrips;
  const int64_t calls = (m1 - m0 + kRows - 1) / kRows * calls_per_tile;
  const int64_t lines = pf && m1 - m0 >= kPrefetchMinRows ? pf_lines : 0;
  const int64_t col = epi.swiglu ? s / 2 * kCols : s * kCols, width = ns * kCols;
  Ahead ahead{reinterpret_cast<const char*>(pf), 0, K};
  alignas(64) float buf[std::max(kRows * 2, kWide) * kCols];
  for (int64_t t = 0, m = m0; m < m1; m += kRows) {
    const int64_t rows = std::min(kRows, m1 - m);
    for (int64_t ss = 0; ss < ns; ++t) {
      ahead.lines = lines * (t + 1) / calls - lines * t / calls;
      ahead.acc = 0;
      const float* ws = w + (s + ss) * K * kCols;
      float* o = epi.any() ? buf + ss * kCols : out + m * N_out + col + ss * kCols;
      const int64_t stride = epi.any() ? width : N_out;
      if (rows == 1 && ns - ss >= kWide) {
        row_strips<kWide>(x + m * K, K, ws, o, ahead);
        ss += kWide;
      } else if (ns - ss >= kStrips) {
        tile_rows<kStrips>(rows, x + m * K, K, ws, o, stride, ahead);
        ss += kStrips;
      } else {
        tile_rows<1>(rows, x + m * K, K, ws, o, stride, ahead);
        ss += 1;
      }
    }
    if (epi.swiglu) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < ns / 2; ++j)
          silu_mul_row(buf + r * width + 2 * kCols * j, out + (m + r) * N_out + col + kCols * j);
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

// One product's work as kernel items: row panels x groups of strips (kStrips, or a SwiGLU
// pair). Items walk the row panels of one strip group before the next: each strip's weights
// come from memory once per call (the head's 113 MB would otherwise stream once per panel),
// and the panels' rows (M x K floats) are re-read from L2/L3. As few panels as keep their x
// rows in L2, of even size (64 rows of SmolLM2: one panel).
struct Product {
  const float* x;  // [M, K]
  const float* w;  // [S, K, 16]
  float* out;      // [M, N_out]
  int64_t M, K, S, N_out;
  Epilogue epi;
  int64_t gs, panels, groups, rows;  // strips per item; row panels, strip groups, rows per panel

  Product(const float* x, const float* w, float* out, int64_t M, int64_t K, int64_t S, int64_t N_out, Epilogue epi)
      : x(x), w(w), out(out), M(M), K(K), S(S), N_out(N_out), epi(epi) {
    const int64_t cap = std::max(kRows, kPanelBytes / (K * 4) / kRows * kRows);
    gs = M == 1 ? kWide : epi.swiglu ? 2 : kStrips;  // (a 1-row item: row_strips; SwiGLU: 2 pairs)
    panels = (M + cap - 1) / cap;
    groups = (S + gs - 1) / gs;
    rows = ((M + panels - 1) / panels + kRows - 1) / kRows * kRows;
  }
  int64_t items() const { return panels * groups; }
  int64_t first_strip(int64_t i) const { return (i / panels) * gs; }
  const float* weights(int64_t i) const { return w + first_strip(i) * K * kCols; }
  int64_t lines(int64_t i) const { return std::min(gs, S - first_strip(i)) * K; }  // a strip: K lines
  void run(int64_t i, const float* pf, int64_t pf_lines) const {
    const int64_t s = first_strip(i), m0 = (i % panels) * rows;
    panel(x, w, out, K, N_out, s, std::min(gs, S - s), m0, std::min(M, m0 + rows), pf, pf_lines, epi);
  }
};

// `n` dependent products as one pagedjax::Chain (cpu_parallel.h): each item prefetches the next
// item's weights, the next product's once its own run out (none when the next item reads
// the same strips: another row panel). `between(p)` readies product p + 1's input.
void run_products(ffi::ThreadPool& pool, int64_t threads, const Product* prods, int n,
                  const std::function<void()>& prologue, std::function<void(int)> between) {
  auto ch = std::make_shared<pagedjax::Chain>();
  ch->phases = n;
  for (int p = 0; p < n; ++p) ch->end[p] = ch->begin(p) + prods[p].items();
  ch->count = ch->end[n - 1];
  pagedjax::Chain* c = ch.get();  // (not the shared_ptr: the chain would own itself)
  ch->item = [c, prods](int64_t i, int64_t j) {
    const int p = c->phase_of(i);
    const int64_t li = i - c->begin(p);
    const float* pf = nullptr;
    int64_t lines = 0;
    if (j >= 0) {
      const int q = c->phase_of(j);
      const int64_t lj = j - c->begin(q);
      if (q != p || prods[q].first_strip(lj) != prods[p].first_strip(li)) {
        pf = prods[q].weights(lj);
        lines = prods[q].lines(lj);
      }
    }
    prods[p].run(li, pf, lines);
  };
  ch->between = std::move(between);
  pagedjax::run_phase(pool, threads, ch, prologue);
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
  const float* xs = x.typed_data();
  thread_local std::vector<float> normed;  // (the items read it before this call returns)
  std::function<void()> prologue;
  if (norm.element_count() != 0) {
    normed.resize(M * K);
    prologue = [x = xs, nw = norm.typed_data(), eps, M, K, y = normed.data()] { rms_norm(x, nw, eps, M, K, y); };
    xs = normed.data();
  }
  const Product prod(xs, w.typed_data(), out->typed_data(), M, K, S, N_out,
                     {residual.element_count() ? residual.typed_data() : nullptr, swiglu != 0});
  run_products(pool, num_threads, &prod, 1, prologue, {});
  return ffi::Error::Success();
}

// A decoder layer's products after attention as one call: h1 = h + a wo; then
// out = h1 + swiglu(rms_norm(h1) (gate|up)) w_down; and, given the next layer's norm and
// packed qkv, that layer's first product too: qkv = rms_norm(out) wq|wk|wv. Why one call: at
// a few rows each product is tens of microseconds, and each call paid a helper's wake-up, a
// wait for the slower thread, a cold first item and the XLA ops between; here the products
// run as one Chain, items prefetching the next item's weights across the products'
// boundaries (from 4 rows). The numbers are F32Linear's for the same calls, bit for bit.
ffi::Error F32LayerTail(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> h,
                        ffi::Buffer<ffi::F32> wo, ffi::Buffer<ffi::F32> mlp_norm, ffi::Buffer<ffi::F32> gate_up,
                        ffi::Buffer<ffi::F32> down, ffi::Buffer<ffi::F32> next_norm, ffi::Buffer<ffi::F32> next_qkv,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> qkv_out, int64_t num_threads,
                        float eps) {
  const auto ad = a.dimensions(), hd = h.dimensions(), od = wo.dimensions(), gd = gate_up.dimensions(),
             dd = down.dimensions(), outd = out->dimensions(), nd = next_qkv.dimensions(),
             qd = qkv_out->dimensions();
  if (ad.size() != 2 || hd.size() != 2 || od.size() != 3 || gd.size() != 3 || dd.size() != 3 || outd.size() != 2 ||
      qd.size() != 2) {
    return ffi::Error::InvalidArgument("float32 layer tail: a [M,A], h [M,d], packed wo, gate|up and w_down, out [M,d]");
  }
  const int64_t M = ad[0], A = ad[1], d = hd[1], I = gd[0] * kCols / 2;
  if (hd[0] != M || outd[0] != M || outd[1] != d || od[0] * kCols != d || od[1] != A || od[2] != kCols ||
      gd[0] % 2 || gd[1] != d || gd[2] != kCols || dd[0] * kCols != d || dd[1] != I || dd[2] != kCols ||
      mlp_norm.element_count() != static_cast<size_t>(d)) {
    return ffi::Error::InvalidArgument("float32 layer tail: shapes disagree (wo [d/16,A,16], gate|up pairs "
                                       "[2I/16,d,16], w_down [d/16,I,16], mlp_norm [d])");
  }
  const bool next = next_qkv.element_count() != 0;
  if (next ? (nd.size() != 3 || nd[1] != d || nd[2] != kCols || next_norm.element_count() != static_cast<size_t>(d) ||
              qd[0] != M || qd[1] != nd[0] * kCols)
           : qd[1] != 0) {
    return ffi::Error::InvalidArgument("float32 layer tail: the next layer's qkv [N/16,d,16], its norm [d] and the "
                                       "qkv output [M,N] disagree (or: no next qkv, an [M,0] output)");
  }
  if (M == 0) return ffi::Error::Success();
  thread_local std::vector<float> h1, n1, act, n2;  // (the items read them before this call returns)
  h1.resize(M * d);
  n1.resize(M * d);
  act.resize(M * I);
  n2.resize(next ? M * d : 0);
  const Product prods[4] = {
      {a.typed_data(), wo.typed_data(), h1.data(), M, A, od[0], d, {h.typed_data(), false}},
      {n1.data(), gate_up.typed_data(), act.data(), M, d, gd[0], I, {nullptr, true}},
      {act.data(), down.typed_data(), out->typed_data(), M, I, dd[0], d, {h1.data(), false}},
      {n2.data(), next_qkv.typed_data(), qkv_out->typed_data(), M, d, next ? nd[0] : 0, next ? qd[1] : 0, {}}};
  // (pointers, not the thread_local vectors: this runs on whichever thread ends a product)
  auto between = [h1 = h1.data(), n1 = n1.data(), o = out->typed_data(), n2 = n2.data(), mw = mlp_norm.typed_data(),
                  nw = next_norm.typed_data(), eps, M, d](int p) {
    if (p == 0) rms_norm(h1, mw, eps, M, d, n1);
    if (p == 2) rms_norm(o, nw, eps, M, d, n2);
  };
  run_products(pool, num_threads, prods, next ? 4 : 3, {}, between);
  return ffi::Error::Success();
}

}  // namespace

// 1 when the library was compiled with AVX2 + FMA.
extern "C" int PagedjaxF32LinearVectorized() { return kVectorized ? 1 : 0; }

// The instruction-set path compiled into this build: "avx512" (12 x 32 tiles), "avx2" (AVX2 +
// FMA, 6 x 16 tiles) or "scalar".
extern "C" const char* PagedjaxF32LinearPath() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

// 1 where the kernel serves float32 layers by default (runtime/kernels/cpu/matmul.py): wherever it
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxF32LayerTail, F32LayerTail,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads")
                                  .Attr<float>("eps"));
