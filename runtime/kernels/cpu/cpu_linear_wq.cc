// Weight-only quantized linear layer on CPU as an XLA FFI custom call: y = x @ W with W held as
// 4-bit (GGUF Q4_0 / Q4_1 / Q4_K, or pagedjax's own int4) or 8-bit (GGUF Q8_0) integers, one
// scale (and for 4-bit one offset) per 32 inputs of each output column, and x in float32.
// Built with the other kernels by runtime/kernels/cpu/build.py; runtime/kernels/cpu/matmul.py
// packs the weights (pack_wq) and calls it.
//
// Why: a decode step at a few rows streams every weight once and does little with it, so the
// bytes read set its time. A 4-bit weight is ~1/6 of the float32 bytes (4 bits + 8 bytes of
// scale and offset per 32 values): the kernel reads those bytes as they are stored and turns
// them into floats in registers, never as a float copy in memory. The activations stay
// float32 (weight-only: the only rounding is the weights' own, which the checkpoint has).
//
// Each output is  sum_g ( scale_g * sum_{k in g} q_k x_k  +  min_g * sum_{k in g} x_k ),
// the dequantized weight (q * scale + min) times x regrouped: the same real number as
// x @ dequantized(W), rounded differently (float32 sums).
//
// Layout (pack_wq): x [M, K] float32; w uint8 [S, G, B]: strip s holds columns 16s..16s+15,
// group g inputs 32g..32g+31, B bytes per (strip, group):
//   4-bit, B = 256: byte 16 j + c holds column c's values of inputs 32g + j (low nibble) and
//     32g + 16 + j (high nibble), j < 16 (GGUF Q4_0 / Q4_1's own nibble order within a block);
//   8-bit, B = 512: byte 16 k + c holds column c's int8 value of input 32g + k.
// (Where PagedjaxWqLinearPermuted() is 1, position c of each 16 bytes holds column
// {0,1,2,3,8,9,10,11,4,5,6,7,12,13,14,15}[c]: see the AVX2 decode.)
// sm float32 [S, G, n, 16]: each (strip, group)'s 16 scales, then (n = 2) its 16 offsets.
// Out [M, 16 S] float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_exp.h"
#include "cpu_norm.h"
#include "cpu_parallel.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using pagedjax::rms_norm;

constexpr int64_t kCols = 16;   // columns per strip
constexpr int64_t kGroup = 32;  // inputs per scale

// 16 float32 lanes: one zmm (AVX-512), two ymm (AVX2 + FMA), or an array.
#if defined(__AVX512F__)
constexpr const char* kPath = "avx512";
constexpr int kMaxRows = 8;  // rows per tile (each weight decoded once per tile): 2 x 8 zmm
constexpr bool kPermuted = false;
constexpr float kBias4 = 0.0f, kScale8 = 1.0f;
struct V16 {
  __m512 v;
  static V16 zero() { return {_mm512_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void fma(float a, const V16& b) { v = _mm512_fmadd_ps(_mm512_set1_ps(a), b.v, v); }
  void fma(const V16& a, const V16& b) { v = _mm512_fmadd_ps(a.v, b.v, v); }
  V16 operator+(const V16& o) const { return {_mm512_add_ps(v, o.v)}; }
  V16 operator+(float c) const { return {_mm512_add_ps(v, _mm512_set1_ps(c))}; }
  V16 operator*(float c) const { return {_mm512_mul_ps(v, _mm512_set1_ps(c))}; }
};
// 16 bytes -> the 16 columns' values of two inputs (low and high nibbles)
inline void nibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), m = _mm_set1_epi8(0x0F);
  lo.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
  hi.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
}
inline V16 bytes(const uint8_t* p) {  // 16 int8 -> float
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* kPath = "avx2";
constexpr int kMaxRows = 3;  // 4 ymm per row (sums and outputs) + 4 for the weights: 16 registers
struct V16 {
  __m256 a, b;
  static V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  void store(float* p) const {
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
  }
  void fma(float x, const V16& w) {
    const __m256 xb = _mm256_set1_ps(x);
    a = _mm256_fmadd_ps(xb, w.a, a);
    b = _mm256_fmadd_ps(xb, w.b, b);
  }
  void fma(const V16& s, const V16& w) {
    a = _mm256_fmadd_ps(s.a, w.a, a);
    b = _mm256_fmadd_ps(s.b, w.b, b);
  }
  V16 operator+(const V16& o) const { return {_mm256_add_ps(a, o.a), _mm256_add_ps(b, o.b)}; }
  V16 operator+(float c) const { return {_mm256_add_ps(a, _mm256_set1_ps(c)), _mm256_add_ps(b, _mm256_set1_ps(c))}; }
  V16 operator*(float c) const { return {_mm256_mul_ps(a, _mm256_set1_ps(c)), _mm256_mul_ps(b, _mm256_set1_ps(c))}; }
};
// AVX2 has no one-instruction widening of bytes to 16 floats, so the values are made with
// integer unpacks: a 16-bit word w becomes the float32 whose high half it is. A nibble n as the
// word 0x4300 | n is the bfloat16 of 128 + n, so the float is exactly 128 + n (kBias4: the
// kernel subtracts 128 * scale * sum(x) once per group); an int8 q sign-extended to a word
// gives the int32 q * 2^16, converted exactly (kScale8: folded into the scale). Fewer
// instructions than zero-extending to int32 and converting (on a Zen 3 EPYC the 1-row product
// ran ~25% faster). The unpacks work within each 128-bit half, so each 16-byte row is stored
// with its columns in the order 0-3, 8-11, 4-7, 12-15 (kPermuted, pack_wq): the two halves of
// the result then hold columns 0-7 and 8-15.
constexpr bool kPermuted = true;
constexpr float kBias4 = 128.0f, kScale8 = 65536.0f;
inline V16 high_halves(__m256i w) {
  const __m256i z = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w))};
}
inline void nibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i m = _mm256_set1_epi16(0x0F), bf = _mm256_set1_epi16(0x4300);
  lo = high_halves(_mm256_or_si256(_mm256_and_si256(w, m), bf));
  hi = high_halves(_mm256_or_si256(_mm256_srli_epi16(w, 4), bf));
}
inline V16 bytes(const uint8_t* p) {
  const V16 q = high_halves(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return {_mm256_cvtepi32_ps(_mm256_castps_si256(q.a)), _mm256_cvtepi32_ps(_mm256_castps_si256(q.b))};
}
#else
constexpr const char* kPath = "scalar";
constexpr int kMaxRows = 4;
constexpr bool kPermuted = false;
constexpr float kBias4 = 0.0f, kScale8 = 1.0f;
struct V16 {
  float v[kCols];
  static V16 zero() { return {}; }
  static V16 load(const float* p) {
    V16 r;
    std::memcpy(r.v, p, sizeof r.v);
    return r;
  }
  void store(float* p) const { std::memcpy(p, v, sizeof v); }
  void fma(float x, const V16& w) {
    for (int c = 0; c < kCols; ++c) v[c] += x * w.v[c];
  }
  void fma(const V16& s, const V16& w) {
    for (int c = 0; c < kCols; ++c) v[c] += s.v[c] * w.v[c];
  }
  V16 operator+(float c) const {
    V16 r;
    for (int k = 0; k < kCols; ++k) r.v[k] = v[k] + c;
    return r;
  }
  V16 operator*(float c) const {
    V16 r;
    for (int k = 0; k < kCols; ++k) r.v[k] = v[k] * c;
    return r;
  }
  V16 operator+(const V16& o) const {
    V16 r;
    for (int c = 0; c < kCols; ++c) r.v[c] = v[c] + o.v[c];
    return r;
  }
};
inline void nibbles(const uint8_t* p, V16& lo, V16& hi) {
  for (int c = 0; c < kCols; ++c) {
    lo.v[c] = static_cast<float>(p[c] & 0x0F);
    hi.v[c] = static_cast<float>(p[c] >> 4);
  }
}
inline V16 bytes(const uint8_t* p) {
  V16 r;
  for (int c = 0; c < kCols; ++c) r.v[c] = static_cast<float>(static_cast<int8_t>(p[c]));
  return r;
}
#endif

// Row j of a group's values: its 16 columns at inputs j (a) and 16 + j (b), as decoded floats.
template <int Bits>
inline void decode(const uint8_t* wg, int j, V16& a, V16& b) {
  if constexpr (Bits == 4) {
    nibbles(wg + 16 * j, a, b);
  } else {
    a = bytes(wg + 16 * j);
    b = bytes(wg + 16 * (16 + j));
  }
}

// A group's 16 scales as they multiply the decoded values (kScale8 undone), and its offsets
// with the decoded values' bias (kBias4) taken off: offset - kBias4 * scale.
template <int Bits>
inline V16 scale_of(const float* sm) {
  V16 s = V16::load(sm);
  if constexpr (Bits == 8 && kScale8 != 1.0f) {
    V16 t = V16::zero();
    t.fma(1.0f / kScale8, s);
    s = t;
  }
  return s;
}
inline V16 offset_of(const float* sm) {
  V16 m = V16::load(sm + kCols);
  if constexpr (kBias4 != 0.0f) m.fma(-kBias4, V16::load(sm));
  return m;
}

// R rows of x (row stride K) by one strip: out[r, 0..15] over all G groups. `xsum` [M, G]
// (null without offsets): each row's sum of x over each group. C sets of accumulators per
// row, the group's inputs dealt round-robin over them: at one row a single set is one FMA
// chain per register, which waits out each FMA's latency (4 cycles) instead of issuing two
// per cycle (measured: 1 set at 1 row ran at half the speed of 4).
template <int R, int Bits>
inline void tile(const float* x, int64_t K, int64_t G, const uint8_t* w, const float* sm, int n, const float* xsum,
                 const float* res, float* out, int64_t N) {
  constexpr int64_t B = Bits == 4 ? 256 : 512;
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  V16 y[R];
  for (int r = 0; r < R; ++r) y[r] = res ? V16::load(res + r * N) : V16::zero();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * B;
    const float* xg = x + g * kGroup;
    V16 acc[C][R];
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) acc[c][r] = V16::zero();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      V16 a, b;
      decode<Bits>(wg, j, a, b);
      for (int r = 0; r < R; ++r) {
        acc[j % C][r].fma(xg[r * K + j], a);
        acc[j % C][r].fma(xg[r * K + 16 + j], b);
      }
    }
    const V16 s = scale_of<Bits>(sm + g * n * kCols);
    for (int r = 0; r < R; ++r) {
      V16 t = acc[0][r];
      for (int c = 1; c < C; ++c) t = t + acc[c][r];
      y[r].fma(s, t);
    }
    if (n == 2) {
      const V16 m = offset_of(sm + g * n * kCols);
      for (int r = 0; r < R; ++r) y[r].fma(xsum[r * G + g], m);
    }
  }
  for (int r = 0; r < R; ++r) y[r].store(out + r * N);
}

template <int Bits, int R = kMaxRows>
inline void tile_rows(int rows, const float* x, int64_t K, int64_t G, const uint8_t* w, const float* sm, int n,
                      const float* xsum, const float* res, float* out, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return tile_rows<Bits, R - 1>(rows, x, K, G, w, sm, n, xsum, res, out, N);
  }
  tile<R, Bits>(x, K, G, w, sm, n, xsum, res, out, N);
}

// From kDequantRows rows on, a strip's weights are dequantized once into float32 [K, 16] (in
// L1/L2) and the rows go through a plain float tile: decoding per tile of kMaxRows rows cost
// more than it saved once the rows, not the weight bytes, set the time (SmolLM2, 64 rows:
// 279 ms a step decoding per tile against 206 ms for float32 weights).
constexpr int64_t kDequantRows = 8;
#if defined(__AVX512F__)
constexpr int kFloatRows = 12;
#else
constexpr int kFloatRows = 6;
#endif

template <int Bits>
void dequantize_strip(const uint8_t* w, const float* sm, int n, int64_t G, float* wf) {
  constexpr int64_t B = Bits == 4 ? 256 : 512;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * B;
    // the values with their bias or factor undone first (exact), so each weight is q * s + m
    // rounded once, as the XLA path's dequantization gives it
    const V16 s = V16::load(sm + g * n * kCols);
    const V16 m = n == 2 ? V16::load(sm + g * n * kCols + kCols) : V16::zero();
    float* o = wf + g * kGroup * kCols;
    for (int j = 0; j < 16; ++j) {
      V16 a, b;
      decode<Bits>(wg, j, a, b);
      if constexpr (Bits == 4 && kBias4 != 0.0f) {
        a = a + kBias4 * -1.0f;
        b = b + kBias4 * -1.0f;
      } else if constexpr (Bits == 8 && kScale8 != 1.0f) {
        a = a * (1.0f / kScale8);
        b = b * (1.0f / kScale8);
      }
      V16 da = m, db = m;
      da.fma(s, a);
      db.fma(s, b);
      da.store(o + j * kCols);
      db.store(o + (16 + j) * kCols);
    }
  }
}

template <int R>
inline void float_tile(const float* x, int64_t K, const float* wf, const float* res, float* out, int64_t N) {
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = res ? V16::load(res + r * N) : V16::zero();
  for (int64_t k = 0; k < K; ++k) {
    const V16 wk = V16::load(wf + k * kCols);
    for (int r = 0; r < R; ++r) acc[r].fma(x[r * K + k], wk);
  }
  for (int r = 0; r < R; ++r) acc[r].store(out + r * N);
}

// Two strips' dequantized weights (wa, wb: [K, 16] each) at once: each broadcast of x feeds two
// FMAs, where one strip's tile is bound by its loads (a broadcast per FMA). AVX-512 only: 2 x 12
// accumulators fit its 32 registers; AVX2's 16 would spill.
#if defined(__AVX512F__)
constexpr int kPairRows = 12;
template <int R>
inline void float_tile2(const float* x, int64_t K, const float* wa, const float* wb, const float* res, float* out,
                        int64_t N) {
  V16 a[R], b[R];
  for (int r = 0; r < R; ++r) {
    a[r] = res ? V16::load(res + r * N) : V16::zero();
    b[r] = res ? V16::load(res + r * N + kCols) : V16::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    const V16 wka = V16::load(wa + k * kCols), wkb = V16::load(wb + k * kCols);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
      a[r].fma(xv, wka);
      b[r].fma(xv, wkb);
    }
  }
  for (int r = 0; r < R; ++r) {
    a[r].store(out + r * N);
    b[r].store(out + r * N + kCols);
  }
}

template <int R = kPairRows>
inline void float_rows2(int rows, const float* x, int64_t K, const float* wa, const float* wb, const float* res,
                        float* out, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return float_rows2<R - 1>(rows, x, K, wa, wb, res, out, N);
  }
  float_tile2<R>(x, K, wa, wb, res, out, N);
}
#else
constexpr int kPairRows = 0;
#endif

template <int R = kFloatRows>
inline void float_rows(int rows, const float* x, int64_t K, const float* wf, const float* res, float* out,
                       int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return float_rows<R - 1>(rows, x, K, wf, res, out, N);
  }
  float_tile<R>(x, K, wf, res, out, N);
}

// One packed weight's shape, checked: w [S, G, 256|512], sm [S, G, 1|2, 16] over K inputs.
struct Packed {
  const uint8_t* w;
  const float* sm;
  int64_t S, G, B;
  int n;
  bool ok;
  Packed(ffi::Buffer<ffi::U8>& wb, ffi::Buffer<ffi::F32>& sb, int64_t K) {
    const auto wd = wb.dimensions(), sd = sb.dimensions();
    // 4-bit values come with offsets (n = 2), 8-bit ones without (n = 1): the decode's bias
    // (kBias4) is taken off through the offsets
    ok = wd.size() == 3 && sd.size() == 4 && (wd[2] == 256 || wd[2] == 512) && wd[1] * kGroup == K &&
         sd[0] == wd[0] && sd[1] == wd[1] && sd[2] == (wd[2] == 256 ? 2 : 1) && sd[3] == kCols;
    w = wb.typed_data();
    sm = sb.typed_data();
    S = ok ? wd[0] : 0;
    G = ok ? wd[1] : 0;
    B = ok ? wd[2] : 0;
    n = ok ? static_cast<int>(sd[2]) : 0;
  }
  int64_t N() const { return S * kCols; }
};

// Each row's sum of x over each group of 32 inputs, [M, K/32]: the offsets' term.
void group_sums(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float t = 0.0f;
      for (int64_t k = 0; k < kGroup; ++k) t += x[r * K + g * kGroup + k];
      out[r * G + g] = t;
    }
}

// out [M, N] = x [M, K] @ W (+ res [M, N], or null) as work items of a few strips each.
// `xsum`: group_sums(x), read below kDequantRows rows when W has offsets (needs_sums).
struct Product {
  const float* x;
  int64_t M, K;
  Packed w;
  const float* xsum;
  const float* res;
  float* out;
  int64_t per;  // strips per item: enough items for the threads to share the work evenly

  Product(const float* x, int64_t M, int64_t K, const Packed& w, const float* xsum, const float* res, float* out,
          int64_t threads)
      : x(x), M(M), K(K), w(w), xsum(xsum), res(res), out(out),
        per(std::max<int64_t>(1, w.S / (8 * std::max<int64_t>(threads, 1)))) {}
  bool needs_sums() const { return w.n == 2 && M < kDequantRows; }
  int64_t items() const { return (w.S + per - 1) / per; }

  void run(int64_t i) const {
    thread_local std::vector<float> wf;  // one strip dequantized, [K, 16]
    const int64_t S = w.S, G = w.G, B = w.B, N = w.N();
    const int n = w.n;
    for (int64_t s = i * per; s < std::min(S, (i + 1) * per); ++s) {
      const uint8_t* ws = w.w + s * G * B;
      const float* ss = w.sm + s * G * n * kCols;
      if (M >= kDequantRows) {
        const bool pair = kPairRows > 0 && s + 1 < std::min(S, (i + 1) * per);
        wf.resize(2 * K * kCols);
        for (int64_t t = 0; t <= (pair ? 1 : 0); ++t) {
          if (B == 256) {
            dequantize_strip<4>(ws + t * G * B, ss + t * G * n * kCols, n, G, wf.data() + t * K * kCols);
          } else {
            dequantize_strip<8>(ws + t * G * B, ss + t * G * n * kCols, n, G, wf.data() + t * K * kCols);
          }
        }
#if defined(__AVX512F__)
        if (pair) {
          for (int64_t m = 0; m < M; m += kPairRows)
            float_rows2(static_cast<int>(std::min<int64_t>(kPairRows, M - m)), x + m * K, K, wf.data(),
                        wf.data() + K * kCols, res ? res + m * N + s * kCols : nullptr, out + m * N + s * kCols, N);
          ++s;  // (both strips done)
          continue;
        }
#endif
        for (int64_t m = 0; m < M; m += kFloatRows)
          float_rows(static_cast<int>(std::min<int64_t>(kFloatRows, M - m)), x + m * K, K, wf.data(),
                     res ? res + m * N + s * kCols : nullptr, out + m * N + s * kCols, N);
        continue;
      }
      for (int64_t m = 0; m < M; m += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m));
        const float* xg = needs_sums() ? xsum + m * G : nullptr;
        float* om = out + m * N + s * kCols;
        const float* rm = res ? res + m * N + s * kCols : nullptr;
        if (B == 256) {
          tile_rows<4>(rows, x + m * K, K, G, ws, ss, n, xg, rm, om, N);
        } else {
          tile_rows<8>(rows, x + m * K, K, G, ws, ss, n, xg, rm, om, N);
        }
      }
    }
  }
};

// out = [rms_norm](x) @ W [+ residual]: the norm (`norm` [K], or empty) before the product
// and the residual ([M, N], or empty) added in the tile, as the float kernel does, so a
// decode step runs no separate XLA ops for them.
ffi::Error WqLinear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> sm,
                    ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> norm, ffi::ResultBuffer<ffi::F32> out,
                    int64_t num_threads, float eps) {
  const auto xd = x.dimensions(), od = out->dimensions();
  const Packed pw(w, sm, xd.size() == 2 ? xd[1] : -1);
  if (xd.size() != 2 || od.size() != 2 || !pw.ok || od[0] != xd[0] || od[1] != pw.N()) {
    return ffi::Error::InvalidArgument(
        "quantized linear: x [M,K], w [N/16,K/32,256|512], scales [N/16,K/32,2|1,16] (4-bit: scales and "
        "offsets, 8-bit: scales), out [M,N] disagree");
  }
  const int64_t M = xd[0], K = xd[1], N = od[1];
  if (residual.element_count() != 0 && residual.element_count() != static_cast<size_t>(M * N)) {
    return ffi::Error::InvalidArgument("quantized linear: the residual must be [M, N]");
  }
  if (norm.element_count() != 0 && norm.element_count() != static_cast<size_t>(K)) {
    return ffi::Error::InvalidArgument("quantized linear: the norm weight must have K elements");
  }
  if (M == 0 || pw.S == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  thread_local std::vector<float> normed;  // (the items read it before this call returns)
  if (norm.element_count() != 0) {
    normed.resize(M * K);
    rms_norm(xs, norm.typed_data(), eps, M, K, normed.data());
    xs = normed.data();
  }
  thread_local std::vector<float> sums;  // [M, G] (the items read it before this call returns)
  Product prod(xs, M, K, pw, nullptr, residual.element_count() ? residual.typed_data() : nullptr,
               out->typed_data(), num_threads);
  if (prod.needs_sums()) {
    sums.resize(M * pw.G);
    group_sums(xs, M, K, sums.data());
    prod.xsum = sums.data();
  }
  pagedjax::run_parallel(pool, num_threads, prod.items(), [prod](int64_t i) { prod.run(i); });
  return ffi::Error::Success();
}

// A Llama-style decoder layer after attention as one call, weight-only quantized: h1 = h +
// a wo; out = h1 + swiglu(rms_norm(h1) gate|up) w_down (gate|up: the gate's columns, then
// the up's); and, given the next layer's norm and packed qkv, that layer's first product:
// qkv = rms_norm(out) wq|wk|wv. Why one call: at one row a product is ~50 us, and each
// separate call paid the custom call's dispatch, a helper's wake-up and the XLA ops between
// (the SwiGLU, the splits): SmolLM2's batch-1 step spent a quarter of its time outside the
// products. The products are WqLinear's; the SwiGLU is the float kernel's formula.
ffi::Error WqLayerTail(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> h,
                       ffi::Buffer<ffi::U8> wo, ffi::Buffer<ffi::F32> wo_sm, ffi::Buffer<ffi::F32> mlp_norm,
                       ffi::Buffer<ffi::U8> gate_up, ffi::Buffer<ffi::F32> gate_up_sm, ffi::Buffer<ffi::U8> down,
                       ffi::Buffer<ffi::F32> down_sm, ffi::Buffer<ffi::F32> next_norm, ffi::Buffer<ffi::U8> next_qkv,
                       ffi::Buffer<ffi::F32> next_qkv_sm, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> qkv_out, int64_t num_threads, float eps) {
  const auto ad = a.dimensions(), hd = h.dimensions(), outd = out->dimensions(), qd = qkv_out->dimensions();
  if (ad.size() != 2 || hd.size() != 2 || outd.size() != 2 || qd.size() != 2) {
    return ffi::Error::InvalidArgument("quantized layer tail: a [M,A], h [M,d], out [M,d], qkv out [M,N]");
  }
  const int64_t M = ad[0], A = ad[1], d = hd[1];
  const Packed po(wo, wo_sm, A), pg(gate_up, gate_up_sm, d);
  const int64_t I = pg.N() / 2;
  const Packed pd(down, down_sm, I);
  if (hd[0] != M || outd[0] != M || outd[1] != d || !po.ok || po.N() != d || !pg.ok || pg.S % 2 || !pd.ok ||
      pd.N() != d || mlp_norm.element_count() != static_cast<size_t>(d)) {
    return ffi::Error::InvalidArgument("quantized layer tail: shapes disagree (wo [d/16,A/32,.], gate|up "
                                       "[2I/16,d/32,.], w_down [d/16,I/32,.], mlp_norm [d])");
  }
  const bool next = next_qkv.element_count() != 0;
  const Packed pn(next_qkv, next_qkv_sm, d);
  if (next ? (!pn.ok || next_norm.element_count() != static_cast<size_t>(d) || qd[0] != M || qd[1] != pn.N())
           : qd[1] != 0) {
    return ffi::Error::InvalidArgument("quantized layer tail: the next layer's qkv [N/16,d/32,.], its norm [d] "
                                       "and the qkv output [M,N] disagree (or: no next qkv, an [M,0] output)");
  }
  if (M == 0) return ffi::Error::Success();
  // (pointers into these, not the vectors: items and `between` run on whichever thread)
  thread_local std::vector<float> h1, n1, gu, act, sums;
  h1.resize(M * d);
  n1.resize(M * d);
  gu.resize(M * 2 * I);
  act.resize(M * I);
  const int64_t G0 = A / kGroup, G1 = d / kGroup, G2 = I / kGroup;
  sums.resize(M * (G0 + G1 + G2 + G1));
  float *s0 = sums.data(), *s1 = s0 + M * G0, *s2 = s1 + M * G1, *s3 = s2 + M * G2;
  float* o = out->typed_data();
  const Product prods[4] = {
      {a.typed_data(), M, A, po, s0, h.typed_data(), h1.data(), num_threads},
      {n1.data(), M, d, pg, s1, nullptr, gu.data(), num_threads},
      {act.data(), M, I, pd, s2, h1.data(), o, num_threads},
      {n1.data(), M, d, pn, s3, nullptr, next ? qkv_out->typed_data() : nullptr, num_threads}};
  // The products as one Chain (cpu_parallel.h): phase p + 1's items wait for phase p's and
  // for `between(p)`, which makes p + 1's input (a norm, the SwiGLU) on the thread that ends
  // p. (Separate run_parallel calls inside one call measured slower than separate calls: each
  // ended waiting for the other thread, then woke it again.)
  auto ch = std::make_shared<pagedjax::Chain>();
  ch->phases = next ? 4 : 3;
  for (int p = 0; p < ch->phases; ++p) ch->end[p] = ch->begin(p) + prods[p].items();
  ch->count = ch->end[ch->phases - 1];
  pagedjax::Chain* c = ch.get();  // (not the shared_ptr: the chain would own itself)
  const Product* ps = prods;
  ch->item = [c, ps](int64_t i, int64_t) {
    const int p = c->phase_of(i);
    ps[p].run(i - c->begin(p));
  };
  ch->between = [ps, h1 = h1.data(), n1 = n1.data(), gu = gu.data(), act = act.data(), o, eps, M, d, I,
                 mw = mlp_norm.typed_data(), nw = next_norm.typed_data()](int p) {
    if (p == 0) rms_norm(h1, mw, eps, M, d, n1);
    if (p == 1) {
      for (int64_t r = 0; r < M; ++r) {
        const float* g = gu + r * 2 * I;
        float* y = act + r * I;
        for (int64_t j = 0; j < I; ++j) y[j] = g[j] * g[I + j] / (1.0f + pagedjax::fast_exp(std::min(-g[j], 87.0f)));
      }
    }
    if (p == 2) rms_norm(o, nw, eps, M, d, n1);  // (n1 is free again: the next layer's normed input)
    const Product& nxt = ps[p + 1];
    if (nxt.needs_sums()) group_sums(nxt.x, M, nxt.K, const_cast<float*>(nxt.xsum));
  };
  pagedjax::run_phase(pool, num_threads, ch, [ps, M] {
    if (ps[0].needs_sums()) group_sums(ps[0].x, M, ps[0].K, const_cast<float*>(ps[0].xsum));
  });
  return ffi::Error::Success();
}

}  // namespace

// The instruction-set path compiled into this build: "avx512", "avx2" (AVX2 + FMA) or "scalar".
extern "C" const char* PagedjaxWqLinearPath() { return kPath; }

// 1 when each 16-byte row of packed values holds its columns in the order 0-3, 8-11, 4-7,
// 12-15 (the AVX2 decode's), 0 when in order (runtime/kernels/cpu/matmul.py pack_wq asks).
extern "C" int PagedjaxWqLinearPermuted() { return kPermuted ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxWqLinear, WqLinear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxWqLayerTail, WqLayerTail,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads")
                                  .Attr<float>("eps"));
