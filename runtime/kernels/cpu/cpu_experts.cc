// A mixture of experts' grouped product on CPU as an XLA FFI custom call
// (runtime/kernels/cpu/experts.py): x [M, K] float32 with its rows sorted by expert (sizes [E]
// rows each), times each row's expert's matrix, read straight from the stacked weights at
// layer `layer`, packed in 64-column strips w [L, E, S, K, 64] (S = ceil(N / 64), the last
// strip's missing columns zero: experts.pack) -> out [M, N].
//
// Why not XLA: ragged_dot lowers on XLA:CPU to one masked product per expert over every row,
// and a loop of per-expert products copies each expert's matrix out of the stacked weights
// first (a custom call's operand is a whole buffer, so this one takes all layers and indexes
// them itself). Work items are (expert with rows, 64-column strip); an item walks K in blocks
// of kKBlock so its strip of weights stays in L2 while the expert's rows pass over it, up to
// kRows rows at a time in registers. Why strips: a column block of a [K, N] matrix is K rows
// N floats apart, a new page per k (the first version, unpacked, ran 2-4x slower than XLA's
// loop over the same experts).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using pagedjax::run_parallel;

constexpr int64_t kStrip = 64;    // columns per work item
constexpr int64_t kKBlock = 256;  // inputs per pass over a strip (256 x 64 floats: 64 KiB)
constexpr int kRows = 6;          // rows in registers: 6 x 4 accumulators + 4 weights + 1 broadcast

struct Item {
  int64_t row0, rows, n0;  // the expert's first row, its row count, the strip's first column
  const float* w;          // the strip [K, 64]
};

#if defined(__AVX512F__)
// R rows of one strip over inputs [k0, k1): out (+)= x w, accumulating across K blocks.
template <int R>
inline void strip_rows(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t k0, int64_t k1,
                       int64_t n0, const __mmask16* m) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[j], out + r * N + n0 + 16 * j);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kStrip;
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(out + r * N + n0 + 16 * j, m[j], acc[r][j]);
}

void run_item(const Item& it, const float* x, float* out, int64_t K, int64_t N) {
  const int64_t cols = std::min(kStrip, N - it.n0);
  __mmask16 m[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t c = std::clamp<int64_t>(cols - 16 * j, 0, 16);
    m[j] = static_cast<__mmask16>(c == 16 ? 0xFFFF : (1u << c) - 1);
  }
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    for (int64_t r = 0; r < it.rows;) {
      const float* xr = x + (it.row0 + r) * K;
      float* o = out + (it.row0 + r) * N;
      switch (std::min<int64_t>(kRows, it.rows - r)) {
        case 6: strip_rows<6>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 6; break;
        case 5: strip_rows<5>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 5; break;
        case 4: strip_rows<4>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 4; break;
        case 3: strip_rows<3>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 3; break;
        case 2: strip_rows<2>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 2; break;
        default: strip_rows<1>(xr, it.w, o, K, N, k0, k1, it.n0, m); r += 1; break;
      }
    }
  }
}
#else
void run_item(const Item& it, const float* x, float* out, int64_t K, int64_t N) {
  const int64_t cols = std::min(kStrip, N - it.n0);
  for (int64_t r = 0; r < it.rows; ++r) {
    float acc[kStrip] = {};
    const float* xr = x + (it.row0 + r) * K;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = xr[k];
      const float* wk = it.w + k * kStrip;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) acc[c] += xv * wk[c];
    }
    std::memcpy(out + (it.row0 + r) * N + it.n0, acc, cols * sizeof(float));
  }
}
#endif

ffi::Error ExpertProducts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> sizes, ffi::ResultBuffer<ffi::F32> out,
                          int64_t num_threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 5 || od.size() != 2 || wd[3] != xd[1] || wd[4] != kStrip || od[0] != xd[0] ||
      wd[2] != (od[1] + kStrip - 1) / kStrip || sizes.element_count() != static_cast<size_t>(wd[1]) ||
      layer.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "expert products: x [M,K], w [L,E,ceil(N/64),K,64], layer [1], sizes [E], out [M,N] disagree");
  }
  const int64_t M = xd[0], K = xd[1], L = wd[0], E = wd[1], S = wd[2], N = od[1];
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("expert products: layer out of range");
  const int32_t* sz = sizes.typed_data();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (sz[e] < 0) return ffi::Error::InvalidArgument("expert products: a negative group size");
    total += sz[e];
  }
  if (total != M) return ffi::Error::InvalidArgument("expert products: the group sizes must sum to the rows of x");
  std::vector<Item> items;
  for (int64_t e = 0, row = 0; e < E; row += sz[e], ++e) {
    if (sz[e] == 0) continue;
    const float* we = w.typed_data() + (l * E + e) * S * K * kStrip;
    for (int64_t s = 0; s < S; ++s) items.push_back({row, sz[e], s * kStrip, we + s * K * kStrip});
  }
  const float* xs = x.typed_data();
  float* o = out->typed_data();
  if (K == 0) {
    std::fill(o, o + M * N, 0.0f);
    return ffi::Error::Success();
  }
  run_parallel(pool, num_threads, static_cast<int64_t>(items.size()),
               [&](int64_t i) { run_item(items[i], xs, o, K, N); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxExpertProducts, ExpertProducts,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K], rows sorted by expert
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [L, E, S, K, 64]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sizes [E]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));
