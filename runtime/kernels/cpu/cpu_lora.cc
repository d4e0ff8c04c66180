// LoRA's batched low-rank products on CPU as an XLA FFI custom call (runtime/kernels/cpu/lora.py):
// each row t of x [M, K] float32 times its adapter slot's matrices at layer `layer`, read in
// place from the whole slot table: a [L, S, K, P*R], b [L, S, R, N]. A stored projection holding
// P of the model's (q|k|v) has P parts side by side: part p's columns [parts[p], parts[p+1]) of
// out are u[t, pR:(p+1)R] @ b[.., :, those columns], u[t] = x[t] @ a[layer, slot[t]]. A row
// whose slot is -1 gets zeros.
//
// Why not XLA: the sorted-segment loop (runtime/model/lora.py) runs a few-row product per slot
// in an XLA while loop, whose per-iteration cost (dynamic slices of the table, tiny dots) was
// most of a LoRA step's extra time; the one-hot and per-row gather forms read or compute S
// times more. Here the rows are grouped by slot (a counting pass) and each work item, a slot's
// run of up to kRows rows, reads that slot's a and b once (they stay in L1/L2 while its rows
// pass): the step's extra bytes are each active adapter's matrices once, its FLOPs the rows'
// own M * R * (K + N).

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

constexpr int64_t kRows = 8;       // rows per work item
constexpr int64_t kMaxRank = 1536;  // P * R: three parts of LoraConfig.max_lora_rank's bound (512)

struct Item {
  int64_t slot, first, count;  // the slot, its first entry in the grouped row list, how many rows
};

// The table holds float32 or bfloat16 (half the bytes a step reads: the products are bound by
// reading each active adapter's matrices); either is multiplied in float32.
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDJAX_LORA_AVX512 1
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// u[i][r0 .. r0 + 16C) = x[rows[i]] @ a[:, those] for B rows at once: each of a's rows is loaded
// once for all B, and B x C independent FMA chains hide the FMA latency.
template <int B, int C, typename W>
void shrink_block(const float* const* xr, const W* a, float* u, int64_t K, int64_t R, int64_t r0) {
  __mmask16 m[C];
  for (int c = 0; c < C; ++c) m[c] = tail_mask(std::max<int64_t>(0, R - r0 - 16 * c));
  __m512 acc[B][C];
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 ak[C];
    for (int c = 0; c < C; ++c) ak[c] = load16(a + k * R + r0 + 16 * c, m[c]);
#pragma GCC unroll 8
    for (int i = 0; i < B; ++i) {
      const __m512 xb = _mm512_set1_ps(xr[i][k]);
      for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(xb, ak[c], acc[i][c]);
    }
  }
  for (int i = 0; i < B; ++i)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(u + i * kMaxRank + r0 + 16 * c, m[c], acc[i][c]);
}

// u[i] = x[rows[i]] @ a, R columns (P * rank) in groups of up to 48 (B x 3 accumulators).
template <int B, typename W>
void shrink(const float* const* xr, const W* a, float* u, int64_t K, int64_t R) {
  for (int64_t r0 = 0; r0 < R;) {
    const int64_t left = R - r0;
    if (left > 32) {
      shrink_block<B, 3>(xr, a, u, K, R, r0);
      r0 += 48;
    } else if (left > 16) {
      shrink_block<B, 2>(xr, a, u, K, R, r0);
      r0 += 32;
    } else {
      shrink_block<B, 1>(xr, a, u, K, R, r0);
      r0 += 16;
    }
  }
}

// out[rows[i]][n0 + .. n1) = u[i] @ b[:, n0 .. n1) for B rows (b's rows ldb floats apart), 64
// columns at a time in registers (B x 4 accumulators).
template <int B, typename W>
void expand(const float* u, const W* b, float* const* orow, int64_t R, int64_t n_begin, int64_t n_end,
            int64_t ldb) {
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 64) {
    __mmask16 m[4];
    for (int j = 0; j < 4; ++j) m[j] = tail_mask(std::max<int64_t>(0, n_end - n0 - 16 * j));
    __m512 acc[B][4];
    for (int i = 0; i < B; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r) {
      const W* br = b + r * ldb + n0;
      __m512 w[4];
      for (int j = 0; j < 4; ++j) w[j] = load16(br + 16 * j, m[j]);
#pragma GCC unroll 4
      for (int i = 0; i < B; ++i) {
        const __m512 ub = _mm512_set1_ps(u[i * kMaxRank + r]);
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(ub, w[j], acc[i][j]);
      }
    }
    for (int i = 0; i < B; ++i)
      for (int j = 0; j < 4; ++j) _mm512_mask_storeu_ps(orow[i] + n0 + 16 * j, m[j], acc[i][j]);
  }
}

// B rows: u by shrink (all B at once), then each part's columns by expand, 4 rows at a time
// (4 x 4 accumulators and 4 weight vectors stay within the 32 registers).
template <int B, typename W>
void rows_block(const float* const* xr, float* const* orow, const W* a, const W* b, int64_t K, int64_t R,
                int64_t N, const int32_t* parts, int64_t P, float* u) {
  shrink<B>(xr, a, u, K, P * R);
  for (int64_t p = 0; p < P; ++p) {
    int i = 0;
    for (; i + 4 <= B; i += 4) expand<4>(u + i * kMaxRank + p * R, b, orow + i, R, parts[p], parts[p + 1], N);
    for (; i < B; ++i) expand<1>(u + i * kMaxRank + p * R, b, orow + i, R, parts[p], parts[p + 1], N);
  }
}
#endif

template <typename W>
void run_item(const Item& it, const int32_t* rows, const float* x, const W* a, const W* b, float* out,
              int64_t K, int64_t R, int64_t N, const int32_t* parts, int64_t P) {
  alignas(64) static thread_local float u[kRows * kMaxRank];
  const float* xr[kRows];
  float* orow[kRows];
  for (int64_t i = 0; i < it.count; ++i) {
    xr[i] = x + rows[it.first + i] * K;
    orow[i] = out + rows[it.first + i] * N;
  }
#if defined(PAGEDJAX_LORA_AVX512)
  for (int64_t i = 0; i < it.count;) {
    const int64_t left = it.count - i;
    if (left >= 8) {
      rows_block<8>(xr + i, orow + i, a, b, K, R, N, parts, P, u);
      i += 8;
    } else if (left >= 4) {
      rows_block<4>(xr + i, orow + i, a, b, K, R, N, parts, P, u);
      i += 4;
    } else if (left >= 2) {
      rows_block<2>(xr + i, orow + i, a, b, K, R, N, parts, P, u);
      i += 2;
    } else {
      rows_block<1>(xr + i, orow + i, a, b, K, R, N, parts, P, u);
      i += 1;
    }
  }
#else
  for (int64_t i = 0; i < it.count; ++i) {
    float* ui = u;
    std::fill(ui, ui + P * R, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const float xv = xr[i][k];
      const W* ak = a + k * P * R;
#pragma omp simd
      for (int64_t r = 0; r < P * R; ++r) ui[r] += xv * to_f32(ak[r]);
    }
    float* ot = orow[i];
    std::fill(ot, ot + N, 0.0f);
    for (int64_t p = 0; p < P; ++p)
      for (int64_t r = 0; r < R; ++r) {
        const float uv = ui[p * R + r];
        const W* br = b + r * N;
#pragma omp simd
        for (int64_t n = parts[p]; n < parts[p + 1]; ++n) ot[n] += uv * to_f32(br[n]);
      }
  }
#endif
}

template <ffi::DataType T>
ffi::Error LoraProducts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                        ffi::Buffer<T> a, ffi::Buffer<T> b, ffi::Buffer<ffi::S32> parts_buf,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t num_threads) {
  const auto xd = x.dimensions(), ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  const int64_t P = static_cast<int64_t>(parts_buf.element_count()) - 1;
  if (xd.size() != 2 || ad.size() != 4 || bd.size() != 4 || od.size() != 2 || ad[2] != xd[1] || bd[0] != ad[0] ||
      bd[1] != ad[1] || P < 1 || ad[3] != P * bd[2] || bd[3] != od[1] || od[0] != xd[0] ||
      slots.element_count() != static_cast<size_t>(xd[0]) || layer.element_count() != 1 || ad[3] > kMaxRank) {
    return ffi::Error::InvalidArgument(
        "lora products: x [M,K], slots [M], a [L,S,K,P*R], b [L,S,R,N], parts [P+1], layer [1], out [M,N] "
        "disagree (P*R <= 1536)");
  }
  const int64_t M = xd[0], K = xd[1], L = ad[0], S = ad[1], R = bd[2], N = od[1];
  const int32_t* parts = parts_buf.typed_data();
  if (parts[0] != 0 || parts[P] != N) return ffi::Error::InvalidArgument("lora products: parts must run 0..N");
  for (int64_t p = 0; p < P; ++p)
    if (parts[p] > parts[p + 1]) return ffi::Error::InvalidArgument("lora products: parts must not decrease");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("lora products: layer out of range");
  const int32_t* sl = slots.typed_data();
  float* o = out->typed_data();
  // rows grouped by slot (counting sort); rows without an adapter are zeros
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t t = 0; t < M; ++t) {
    if (sl[t] >= S) return ffi::Error::InvalidArgument("lora products: a slot out of range");
    if (sl[t] < 0) {
      std::fill(o + t * N, o + (t + 1) * N, 0.0f);
    } else {
      ++count[sl[t] + 1];
    }
  }
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  std::vector<int32_t> rows(count[S]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < M; ++t)
    if (sl[t] >= 0) rows[fill[sl[t]]++] = static_cast<int32_t>(t);
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = count[s]; i < count[s + 1]; i += kRows) items.push_back({s, i, std::min(kRows, count[s + 1] - i)});
  const float* xs = x.typed_data();
  const auto* at = a.typed_data() + static_cast<int64_t>(l) * S * K * P * R;
  const auto* bt = b.typed_data() + static_cast<int64_t>(l) * S * R * N;
  run_parallel(pool, num_threads, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    run_item(it, rows.data(), xs, at + it.slot * K * P * R, bt + it.slot * R * N, o, K, R, N, parts, P);
  });
  return ffi::Error::Success();
}

}  // namespace

#define PAGEDJAX_LORA_BIND(T)                                                            \
  ffi::Ffi::Bind()                                                                       \
      .Ctx<ffi::ThreadPool>()                                                            \
      .Arg<ffi::Buffer<ffi::F32>>()  /* x [M, K] */                                      \
      .Arg<ffi::Buffer<ffi::S32>>()  /* slots [M] (-1: none) */                          \
      .Arg<ffi::Buffer<T>>()         /* a [L, S, K, P*R] */                              \
      .Arg<ffi::Buffer<T>>()         /* b [L, S, R, N] */                                \
      .Arg<ffi::Buffer<ffi::S32>>()  /* parts [P+1] column offsets */                    \
      .Arg<ffi::Buffer<ffi::S32>>()  /* layer [1] */                                     \
      .Ret<ffi::Buffer<ffi::F32>>()                                                      \
      .Attr<int64_t>("num_threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLoraProducts, LoraProducts<ffi::F32>, PAGEDJAX_LORA_BIND(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxLoraProductsBf16, LoraProducts<ffi::BF16>, PAGEDJAX_LORA_BIND(ffi::BF16));
