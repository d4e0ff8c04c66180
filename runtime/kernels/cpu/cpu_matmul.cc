// W8A8 linear layer on CPU as an XLA FFI custom call: y = (quant(x * in) @ Wq) * sx * sw.
// Built with cpu_attention.cc into one library by runtime/kernels/cpu/build.py; runtime/kernels/cpu/matmul.py
// packs the weights and calls it from the jitted step.
//
// Why not XLA: XLA:CPU's int8 x int8 -> int32 dot runs at 130-250 GOP/s on a 2-core
// AVX512-VNNI EPYC whose two cores do ~400 (vpdpbusd, measured), and the per-token
// quantization and rescale around it are separate passes over the activations. This kernel
// quantizes each row once, keeps a 6x64 int32 tile in registers over a K block whose weights
// stay in L1, and writes float32 with the scales applied: 380-570 GOP/s at 64 rows and
// 530-760 at 256-512 on a 2-core Ice Lake Xeon (260-340 at 64 on the Zen 4 EPYC, before the
// accumulators left the stack).
//
// vpdpbusd multiplies unsigned by signed bytes, so activations are stored as q + 128 (u8)
// and the packer's per-column compensation 128 * sum_k W[k, n] is subtracted at the end.
//
// Layout: x [M, K] float32; in_scale [K] float32 or empty (SmoothQuant's input scale);
// w [S, Kp/4, 256] int8 packed by runtime/kernels/cpu/matmul.py: strip s holds columns 64s..64s+63,
// and for each group of 4 k its 64 bytes per 16 columns are (column, k) pairs, the operand
// order of vpdpbusd; Kp = K rounded up to 4. w_scale [N], comp [N] int32. Out [M, N] float32.
//
// Grouped variant (PagedjaxInt8LinearG32): GGUF Q8_0 weights as llama.cpp stores them, one
// scale per 32 k of each column (w_scale [G, N], G = K / 32, comp [G, N] = 128 * the group's
// column sums), so the checkpoint's int8 values are used as they are, never requantized. The
// activations get a scale per row and group of 32 too (sx [M, G]), as llama.cpp quantizes
// them for its Q8_0 dot: y[m, n] = sum_g sx[m, g] * w_scale[g, n] * (a[m, g] . w[g, n]). The
// int32 sums of one group are folded into float32 accumulators after its 8 vpdpbusd steps.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

// The AMX path needs the VNNI build's helpers (tile_store) as well as AMX-INT8.
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define PAGEDJAX_AMX_BUILD 1
#else
#define PAGEDJAX_AMX_BUILD 0
#endif

namespace {

using pagedjax::run_parallel;

constexpr int64_t kStrip = 64;  // output columns per packed strip (4 zmm of 16 int32)
constexpr int64_t kRows = 6;    // rows per register tile: 24 accumulators + 4 weights + 1 broadcast
constexpr int64_t kKBlock = 64;  // groups of 4 k per block: 256 k x 64 columns = 16 KiB of weights in L1

struct Linear {
  const uint8_t* a;     // [M, Kp] quantized activations + 128
  const float* sx;      // [M] per-row scales
  const int8_t* w;      // packed weights
  const float* sw;      // [N]
  const int32_t* comp;  // [N]
  float* out;           // [M, N]
  int64_t M, Kp, N;
};

constexpr int64_t kGroup = 32;  // k per scale group (GGUF Q8_0's block)
constexpr int64_t kGroupQ = kGroup / 4;  // groups of 4 k per scale group

struct GroupedLinear {
  const uint8_t* a;     // [M, K] quantized activations + 128
  const float* sx;      // [M, G] per row and group
  const int8_t* w;      // packed weights (as Linear's, Kp = K)
  const float* sw;      // [G, N]
  const int32_t* comp;  // [G, N]
  float* out;           // [M, N]
  int64_t M, K, N, G;
};

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>

constexpr bool kVectorized = true;

// Row quantization: y = x * in; s = max|y| / 127; q = round(y / s) (half to even, like
// jnp.round) clipped to [-127, 127], stored + 128. Kp - K padding bytes are 128 (zero).
void quantize_row(const float* x, const float* in, int64_t K, int64_t Kp, uint8_t* a, float* sx) {
  auto load = [&](int64_t k, __mmask16 m) {
    const __m512 v = _mm512_maskz_loadu_ps(m, x + k);
    return in ? _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, in + k)) : v;
  };
  auto mask = [&](int64_t k) { return K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1); };
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load(k, mask(k))));
  const float m = _mm512_reduce_max_ps(amax);
  const float s = m > 0.0f ? m / 127.0f : 1.0f;
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t k = 0; k < K; k += 16) {  // (a division, as XLA's path does: the same int8 rows)
    const __mmask16 mk = mask(k);
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(load(k, mk), sv));  // round half to even
    q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127)),
                         _mm512_set1_epi32(128));
    _mm_mask_storeu_epi8(a + k, mk, _mm512_cvtepi32_epi8(q));
  }
  for (int64_t k = K; k < Kp; ++k) a[k] = 128;
  *sx = s;
}


// acc[r][j] += a[r, 4kq:4kq+4] . w[4kq:4kq+4, 16j:16j+16] over kq in [kq0, kq1); the running
// int32 tile lives in `tile` [R][64] between K blocks.
template <int R>
inline void tile_block(const uint8_t* a, int64_t lda, const int8_t* w, int64_t kq0, int64_t kq1, int32_t* tile,
                       bool first) {
  // Four flat arrays, not acc[R][4]: with the 2-D one GCC kept the accumulators on the
  // stack, a load and a store around every vpdpbusd (measured ~110 GOP/s on an Ice Lake).
  __m512i a0[R], a1[R], a2[R], a3[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    int32_t* t = tile + r * kStrip;
    a0[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(t);
    a1[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(t + 16);
    a2[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(t + 32);
    a3[r] = first ? _mm512_setzero_si512() : _mm512_loadu_si512(t + 48);
  }
  for (int64_t kq = kq0; kq < kq1; ++kq) {
    const int8_t* wk = w + kq * 256;
    const __m512i b0 = _mm512_loadu_si512(wk), b1 = _mm512_loadu_si512(wk + 64);
    const __m512i b2 = _mm512_loadu_si512(wk + 128), b3 = _mm512_loadu_si512(wk + 192);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a + r * lda + kq * 4, 4);
      const __m512i x = _mm512_set1_epi32(four);
      a0[r] = _mm512_dpbusd_epi32(a0[r], x, b0);
      a1[r] = _mm512_dpbusd_epi32(a1[r], x, b1);
      a2[r] = _mm512_dpbusd_epi32(a2[r], x, b2);
      a3[r] = _mm512_dpbusd_epi32(a3[r], x, b3);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    int32_t* t = tile + r * kStrip;
    _mm512_storeu_si512(t, a0[r]);
    _mm512_storeu_si512(t + 16, a1[r]);
    _mm512_storeu_si512(t + 32, a2[r]);
    _mm512_storeu_si512(t + 48, a3[r]);
  }
}

// out[m0 + r, n0 + c] = (tile - comp) * sx * sw for `rows` rows and the strip's columns
// below N (tile rows kStrip apart).
inline void tile_store(const Linear& p, const int32_t* tile, int64_t rows, int64_t m0, int64_t n0) {
  for (int j = 0; j < 4; ++j) {
    const int64_t n = n0 + j * 16;
    if (n >= p.N) break;
    const __mmask16 mask = p.N - n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (p.N - n)) - 1);
    const __m512i comp = _mm512_maskz_loadu_epi32(mask, p.comp + n);
    const __m512 sw = _mm512_maskz_loadu_ps(mask, p.sw + n);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i v = _mm512_sub_epi32(_mm512_loadu_si512(tile + r * kStrip + j * 16), comp);
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(p.sx[m0 + r])), sw);
      _mm512_mask_storeu_ps(p.out + (m0 + r) * p.N + n, mask, y);
    }
  }
}

template <int R>
inline void tile_rows(const Linear& p, const int8_t* ws, int64_t kq0, int64_t kq1, int32_t* tile, int64_t m,
                      int64_t n0) {
  tile_block<R>(p.a + m * p.Kp, p.Kp, ws, kq0, kq1, tile + m * kStrip, kq0 == 0);
  if (kq1 * 4 == p.Kp) tile_store(p, tile + m * kStrip, R, m, n0);
}

// One strip of 64 output columns over all rows: K blocks outside, so a block of the strip's
// weights (16 KiB) serves every row tile from L1.
void strip(const Linear& p, int64_t s, std::vector<int32_t>& tile) {
  const int64_t KQ = p.Kp / 4;
  const int8_t* ws = p.w + s * KQ * 256;
  tile.resize(static_cast<size_t>((p.M + kRows) * kStrip));
  for (int64_t kq0 = 0; kq0 < KQ; kq0 += kKBlock) {
    const int64_t kq1 = std::min(KQ, kq0 + kKBlock);
    int64_t m = 0;
    for (; m + kRows <= p.M; m += kRows) tile_rows<kRows>(p, ws, kq0, kq1, tile.data(), m, s * kStrip);
    switch (p.M - m) {
      case 5: tile_rows<5>(p, ws, kq0, kq1, tile.data(), m, s * kStrip); break;
      case 4: tile_rows<4>(p, ws, kq0, kq1, tile.data(), m, s * kStrip); break;
      case 3: tile_rows<3>(p, ws, kq0, kq1, tile.data(), m, s * kStrip); break;
      case 2: tile_rows<2>(p, ws, kq0, kq1, tile.data(), m, s * kStrip); break;
      case 1: tile_rows<1>(p, ws, kq0, kq1, tile.data(), m, s * kStrip); break;
      default: break;
    }
  }
}

#if PAGEDJAX_AMX_BUILD
// AMX (Sapphire Rapids and later): tdpbusd multiplies a 16-row x 64-byte tile of u8
// activations by a 16 x 64-byte tile of s8 weights in VNNI order (row kq = 16 columns x 4 k)
// into a 16 x 16 int32 tile: ~16x the vpdpbusd work per instruction. The packed strip is
// already that order (row kq of columns 16j..16j+15 is 64 bytes at j * 64, rows 256 bytes
// apart), so the same packed weights and the same u8 rows feed both paths, and the int32
// sums, hence the outputs, are identical. Rows go 16 at a time (the activations are padded
// to 16 rows), K 64 bytes at a time (the caller checks Kp % 64 == 0).
constexpr bool kAmx = true;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux lends the 8 KiB of tile registers to a process only on request; once granted it
// holds for every thread of the process.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The strips of one work item: tiles 0-3 accumulate the strip's 4 x 16 columns for 16 rows,
// 4 holds the rows' 64 bytes of k, 5-6 alternate over the weights.
void amx_strip(const Linear& p, int64_t s, int32_t* ctile /* [16][64] */) {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);  // per item: the config is per thread and other code may change it
  const int64_t KQ = p.Kp / 4;
  const int8_t* ws = p.w + s * KQ * 256;
  for (int64_t m0 = 0; m0 < p.M; m0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < p.Kp; k0 += 64) {
      _tile_loadd(4, p.a + m0 * p.Kp + k0, p.Kp);
      const int8_t* wb = ws + (k0 / 4) * 256;
      _tile_loadd(5, wb, 256);
      _tile_loadd(6, wb + 64, 256);
      _tile_dpbusd(0, 4, 5);
      _tile_dpbusd(1, 4, 6);
      _tile_loadd(5, wb + 128, 256);
      _tile_loadd(6, wb + 192, 256);
      _tile_dpbusd(2, 4, 5);
      _tile_dpbusd(3, 4, 6);
    }
    _tile_stored(0, ctile, kStrip * 4);
    _tile_stored(1, ctile + 16, kStrip * 4);
    _tile_stored(2, ctile + 32, kStrip * 4);
    _tile_stored(3, ctile + 48, kStrip * 4);
    tile_store(p, ctile, std::min<int64_t>(16, p.M - m0), m0, s * kStrip);  // the VNNI path's epilogue
  }
  _tile_release();  // (a thread holding dirty tiles makes every context switch save 8 KiB)
}
#endif

// Grouped row quantization: each group of 32 k gets s = max|x| / 127 (1 when all zero) and
// q = round(x / s) clipped to [-127, 127], stored + 128.
void quantize_row_grouped(const float* x, int64_t K, uint8_t* a, float* sx) {
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t g = 0; g * kGroup < K; ++g) {
    const __m512 v0 = _mm512_loadu_ps(x + g * kGroup), v1 = _mm512_loadu_ps(x + g * kGroup + 16);
    const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float s = m > 0.0f ? m / 127.0f : 1.0f;
    const __m512 sv = _mm512_set1_ps(s);
    auto q8 = [&](__m512 v) {  // (clamped in float: the same rounding as jnp.round then clip)
      const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(v, sv), lo), hi));
      return _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128)));
    };
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + g * kGroup), q8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + g * kGroup + 16), q8(v1));
    sx[g] = s;
  }
}

// Rows m0..m0+R-1 of one strip over the K block [kq0, kq1) (whole groups): per group, 8
// vpdpbusd steps into int32 registers, then (sum - comp) * sx * w_scale into the float32
// accumulators. R = 3: 12 int32 + 12 float32 accumulators + 4 weights + 1 broadcast fit
// the 32 zmm registers; the float tile lives in `tile` [R][64] between K blocks.
template <int R>
inline void grouped_block(const GroupedLinear& p, const int8_t* ws, int64_t kq0, int64_t kq1, float* tile,
                          int64_t m0, int64_t n0) {
  const uint8_t* a = p.a + m0 * p.K;
  __m512 f0[R], f1[R], f2[R], f3[R];
  const bool first = kq0 == 0;
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    const float* t = tile + r * kStrip;
    f0[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t);
    f1[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t + 16);
    f2[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t + 32);
    f3[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t + 48);
  }
  int64_t cols = std::min<int64_t>(kStrip, p.N - n0);
  const __mmask16 m[4] = {
      cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(cols, 0)) - 1),
      cols >= 32 ? __mmask16(0xFFFF) : __mmask16((1u << std::clamp<int64_t>(cols - 16, 0, 16)) - 1),
      cols >= 48 ? __mmask16(0xFFFF) : __mmask16((1u << std::clamp<int64_t>(cols - 32, 0, 16)) - 1),
      cols >= 64 ? __mmask16(0xFFFF) : __mmask16((1u << std::clamp<int64_t>(cols - 48, 0, 16)) - 1)};
  for (int64_t gq = kq0; gq < kq1; gq += kGroupQ) {
    __m512i a0[R], a1[R], a2[R], a3[R];
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int64_t kq = gq; kq < gq + kGroupQ; ++kq) {
      const int8_t* wk = ws + kq * 256;
      const __m512i b0 = _mm512_loadu_si512(wk), b1 = _mm512_loadu_si512(wk + 64);
      const __m512i b2 = _mm512_loadu_si512(wk + 128), b3 = _mm512_loadu_si512(wk + 192);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a + r * p.K + kq * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
        a0[r] = _mm512_dpbusd_epi32(a0[r], x, b0);
        a1[r] = _mm512_dpbusd_epi32(a1[r], x, b1);
        a2[r] = _mm512_dpbusd_epi32(a2[r], x, b2);
        a3[r] = _mm512_dpbusd_epi32(a3[r], x, b3);
      }
    }
    const int64_t g = gq / kGroupQ, base = g * p.N + n0;
    auto fold = [&](__m512i* acc, __m512* f, int j) {
      const __m512i comp = _mm512_maskz_loadu_epi32(m[j], p.comp + base + 16 * j);
      const __m512 sw = _mm512_maskz_loadu_ps(m[j], p.sw + base + 16 * j);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r], comp));
        f[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(sw, _mm512_set1_ps(p.sx[(m0 + r) * p.G + g])), f[r]);
      }
    };
    fold(a0, f0, 0);
    fold(a1, f1, 1);
    fold(a2, f2, 2);
    fold(a3, f3, 3);
  }
  const bool last = kq1 * 4 == p.K;
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r) {
    if (last) {  // the strip's columns below N, straight to the output
      float* o = p.out + (m0 + r) * p.N + n0;
      _mm512_mask_storeu_ps(o, m[0], f0[r]);
      if (cols > 16) _mm512_mask_storeu_ps(o + 16, m[1], f1[r]);
      if (cols > 32) _mm512_mask_storeu_ps(o + 32, m[2], f2[r]);
      if (cols > 48) _mm512_mask_storeu_ps(o + 48, m[3], f3[r]);
    } else {
      float* t = tile + r * kStrip;
      _mm512_storeu_ps(t, f0[r]);
      _mm512_storeu_ps(t + 16, f1[r]);
      _mm512_storeu_ps(t + 32, f2[r]);
      _mm512_storeu_ps(t + 48, f3[r]);
    }
  }
}

// One strip of the grouped product: K blocks outside (a block's weights stay in L1 for
// every row tile), as `strip`.
void grouped_strip(const GroupedLinear& p, int64_t s, std::vector<float>& tile) {
  constexpr int64_t R = 3;
  const int64_t KQ = p.K / 4;
  const int8_t* ws = p.w + s * KQ * 256;
  tile.resize(static_cast<size_t>((p.M + R) * kStrip));
  for (int64_t kq0 = 0; kq0 < KQ; kq0 += kKBlock) {
    const int64_t kq1 = std::min(KQ, kq0 + kKBlock);
    int64_t m = 0;
    for (; m + R <= p.M; m += R) grouped_block<R>(p, ws, kq0, kq1, tile.data() + m * kStrip, m, s * kStrip);
    if (p.M - m == 2) grouped_block<2>(p, ws, kq0, kq1, tile.data() + m * kStrip, m, s * kStrip);
    if (p.M - m == 1) grouped_block<1>(p, ws, kq0, kq1, tile.data() + m * kStrip, m, s * kStrip);
  }
}

#else  // no VNNI: the same numbers, one multiply at a time (runtime/kernels/cpu/matmul.py keeps XLA's
       // dot on such machines; this keeps the library whole and the tests meaningful)

constexpr bool kVectorized = false;

// Row quantization: y = x * in; s = max|y| / 127; q = round(y / s) (half to even, like
// jnp.round) clipped to [-127, 127], stored + 128. Kp - K padding bytes are 128 (zero).
void quantize_row(const float* x, const float* in, int64_t K, int64_t Kp, uint8_t* a, float* sx) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(in ? x[k] * in[k] : x[k]));
  const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::nearbyint((in ? x[k] * in[k] : x[k]) / s);
    a[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(q, -127.0f, 127.0f)) + 128);
  }
  for (int64_t k = K; k < Kp; ++k) a[k] = 128;
  *sx = s;
}


void strip(const Linear& p, int64_t s, std::vector<int32_t>&) {
  const int64_t KQ = p.Kp / 4;
  const int8_t* ws = p.w + s * KQ * 256;
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t c = 0; c < kStrip && s * kStrip + c < p.N; ++c) {
      const int64_t n = s * kStrip + c, j = c / 16, l = c % 16;
      int64_t acc = 0;
      for (int64_t kq = 0; kq < KQ; ++kq)
        for (int t = 0; t < 4; ++t) acc += int64_t(p.a[m * p.Kp + kq * 4 + t]) * ws[kq * 256 + j * 64 + l * 4 + t];
      p.out[m * p.N + n] = static_cast<float>(acc - p.comp[n]) * p.sx[m] * p.sw[n];
    }
}


void quantize_row_grouped(const float* x, int64_t K, uint8_t* a, float* sx) {
  for (int64_t g = 0; g * kGroup < K; ++g) {
    float amax = 0.0f;
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
      a[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(std::nearbyint(x[k] / s), -127.0f, 127.0f)) + 128);
    sx[g] = s;
  }
}

void grouped_strip(const GroupedLinear& p, int64_t s, std::vector<float>&) {
  const int64_t KQ = p.K / 4;
  const int8_t* ws = p.w + s * KQ * 256;
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t c = 0; c < kStrip && s * kStrip + c < p.N; ++c) {
      const int64_t n = s * kStrip + c, j = c / 16, l = c % 16;
      float y = 0.0f;
      for (int64_t g = 0; g < p.G; ++g) {
        int32_t acc = 0;
        for (int64_t kq = g * kGroupQ; kq < (g + 1) * kGroupQ; ++kq)
          for (int t = 0; t < 4; ++t) acc += int32_t(p.a[m * p.K + kq * 4 + t]) * ws[kq * 256 + j * 64 + l * 4 + t];
        y += static_cast<float>(acc - p.comp[g * p.N + n]) * (p.sw[g * p.N + n] * p.sx[m * p.G + g]);
      }
      p.out[m * p.N + n] = y;
    }
}

#endif

#if !PAGEDJAX_AMX_BUILD  // no AMX-INT8 in this build: the VNNI loop (or the scalar one) serves all rows
constexpr bool kAmx = false;
bool amx_permitted() { return false; }
void amx_strip(const Linear&, int64_t, int32_t*) {}
#endif

// AMX on or off for the whole process: the engine sets it from its KernelConfig
// (PagedjaxSetAmx); until then PAGEDJAX_AMX=0 turns it off (an A/B; the outputs are the same).
std::atomic<bool>& amx_enabled() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("PAGEDJAX_AMX");
    return !(v && v[0] == '0');
  }()};
  return on;
}

ffi::Error Int8Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> in_scale,
                      ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> comp,
                      ffi::ResultBuffer<ffi::F32> out, int64_t num_threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || od.size() != 2 || wd[2] != 256 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument("int8 linear: x [M,K], packed w [S,Kp/4,256], out [M,N]");
  }
  const int64_t M = xd[0], K = xd[1], S = wd[0], Kp = wd[1] * 4, N = od[1];
  const bool has_in = in_scale.element_count() > 0;
  if (Kp < K || Kp - K >= 4 || N > S * kStrip || N <= (S - 1) * kStrip ||
      w_scale.element_count() != static_cast<size_t>(N) || comp.element_count() != static_cast<size_t>(N) ||
      (has_in && in_scale.element_count() != static_cast<size_t>(K))) {
    return ffi::Error::InvalidArgument("int8 linear: shapes of x, weights, scales and output disagree");
  }
  if (M == 0) return ffi::Error::Success();
  // AMX from 16 rows on (below, most of each 16-row tile would be padding) where the CPU has
  // it, the OS lends it and PAGEDJAX_AMX is not 0 (an A/B switch; the outputs are the same).
  const bool amx = kAmx && M >= 16 && Kp % 64 == 0 && amx_enabled().load(std::memory_order_relaxed) &&
                   amx_permitted();
  // Quantized rows and their scales, reused across calls of this thread (the helpers only
  // read them while this call waits for them). AMX reads whole 16-row tiles: padding rows.
  thread_local std::vector<uint8_t> a;
  thread_local std::vector<float> sx;
  a.resize(static_cast<size_t>((amx ? (M + 15) / 16 * 16 : M) * Kp), 128);
  sx.resize(static_cast<size_t>(M));
  const float* xs = x.typed_data();
  const float* in = has_in ? in_scale.typed_data() : nullptr;
  uint8_t* ap = a.data();  // (a name of a thread_local means each thread's own copy: pass pointers)
  float* sp = sx.data();
  const int64_t chunk = 16;  // rows per quantization item
  auto quantize = [=](int64_t i) {
    for (int64_t m = i * chunk; m < std::min(M, (i + 1) * chunk); ++m)
      quantize_row(xs + m * K, in, K, Kp, ap + m * Kp, sp + m);
  };
  const int64_t items = (M + chunk - 1) / chunk;
  if (M * K > (1 << 17)) {  // (smaller: a pool wake-up costs more than the pass)
    run_parallel(pool, num_threads, items, quantize);
  } else {
    for (int64_t i = 0; i < items; ++i) quantize(i);
  }
  const Linear p{ap, sp, w.typed_data(), w_scale.typed_data(), comp.typed_data(), out->typed_data(),
                 M, Kp, N};
  run_parallel(pool, num_threads, S, [&](int64_t s) {
    thread_local std::vector<int32_t> tile;
    if (amx) {
      tile.resize(16 * kStrip);
      amx_strip(p, s, tile.data());
    } else {
      strip(p, s, tile);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Int8LinearG32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                         ffi::Buffer<ffi::F32> w_scale, ffi::Buffer<ffi::S32> comp, ffi::ResultBuffer<ffi::F32> out,
                         int64_t num_threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = w_scale.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 2 || od.size() != 2 || wd[2] != 256 || od[0] != xd[0]) {
    return ffi::Error::InvalidArgument("grouped int8 linear: x [M,K], packed w [S,K/4,256], w_scale [G,N], out [M,N]");
  }
  const int64_t M = xd[0], K = xd[1], S = wd[0], N = od[1], G = sd[0];
  if (K % kGroup || wd[1] * 4 != K || G * kGroup != K || sd[1] != N || N > S * kStrip || N <= (S - 1) * kStrip ||
      comp.element_count() != static_cast<size_t>(G * N)) {
    return ffi::Error::InvalidArgument("grouped int8 linear: shapes of x, weights, group scales and output disagree "
                                       "(K must be a multiple of 32)");
  }
  if (M == 0) return ffi::Error::Success();
  thread_local std::vector<uint8_t> a;
  thread_local std::vector<float> sx;
  a.resize(static_cast<size_t>(M * K));
  sx.resize(static_cast<size_t>(M * G));
  const float* xs = x.typed_data();
  uint8_t* ap = a.data();
  float* sp = sx.data();
  const int64_t chunk = 16;
  auto quantize = [=](int64_t i) {
    for (int64_t m = i * chunk; m < std::min(M, (i + 1) * chunk); ++m)
      quantize_row_grouped(xs + m * K, K, ap + m * K, sp + m * G);
  };
  const int64_t items = (M + chunk - 1) / chunk;
  if (M * K > (1 << 17)) {
    run_parallel(pool, num_threads, items, quantize);
  } else {
    for (int64_t i = 0; i < items; ++i) quantize(i);
  }
  const GroupedLinear p{ap, sp, w.typed_data(), w_scale.typed_data(), comp.typed_data(), out->typed_data(), M, K, N, G};
  run_parallel(pool, num_threads, S, [&](int64_t s) {
    thread_local std::vector<float> tile;
    grouped_strip(p, s, tile);
  });
  return ffi::Error::Success();
}

}  // namespace

// 1 when the library was compiled with AVX512-VNNI (runtime/kernels/cpu/matmul.py serves w8a8 layers
// with this kernel only then).
extern "C" int PagedjaxInt8LinearVectorized() { return kVectorized ? 1 : 0; }

// 1 when w8a8 products of 16+ rows run on AMX tiles here (compiled in, and the OS lends them).
extern "C" void PagedjaxSetAmx(int on) { amx_enabled().store(on != 0); }
extern "C" void PagedjaxSetLingerUs(int64_t us) { pagedjax::linger_setting_ns().store(us * 1000); }
extern "C" int PagedjaxInt8LinearAmx() { return kAmx && amx_permitted() ? 1 : 0; }

// The instruction-set path compiled into this build (runtime/kernels/cpu/build.py variants):
// "amx" (AVX512-VNNI and AMX-INT8: tiles from 16 rows where the OS lends them, VNNI below),
// "avx512-vnni", or "scalar" (any build without AVX512-VNNI, AVX2 ones included).
extern "C" const char* PagedjaxInt8LinearPath() { return kAmx ? "amx" : kVectorized ? "avx512-vnni" : "scalar"; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxInt8Linear, Int8Linear,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxInt8LinearG32, Int8LinearG32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));
