// Paged attention on CPU as an XLA FFI custom call, in two modes:
//   decode   every sequence's last query token against its whole paged context, GQA groups
//            sharing each K/V read;
//   prefill  (seq_of/pos given) the other tokens of prefill chunks, in tiles of consecutive
//            tokens of one sequence, each row causal up to its own position.
// Both read a prefix that many sequences share (a system prompt) once for all of them first
// (cascade). Built by runtime/kernels/cpu/build.py (g++ -O3 -march=native) and called inside the
// jitted step (runtime/model/xla_attention.py).
//
// Why not XLA: at 64 sequences of ~370 tokens XLA:CPU runs the batched tiny products
// (3 query rows x 64 dims against 16-32 tokens per sequence and head) at ~25 GFLOP/s; a
// loop that keeps 16 query rows and their accumulators in registers while it streams the
// blocks they read does the same work several times faster.
//
// Layout (as runtime/model/xla_attention.py): q [S, H, G, D] already scaled by 1/sqrt(D) (S = sequences
// in decode, tokens in prefill); caches [NB, BS, H, D] float32, or int8 with float16 scales and
// zeros [NB, BS, H, QG] (value = q * scale + zero per D/QG channels: the *Int8 targets); kv_lens [S] (decode; 0 = no query: output zeros);
// block_tables [rows, MB] (absolute block rows, the layer's base included); seq_of, pos [S]
// (prefill: the token's table row and position, pos -1 = not this kernel's: output zeros;
// empty in decode); window [1] (0 = full attention; else a query at position p sees only keys
// p - window < k <= p, and blocks wholly before that are not read). Output [S, H, G, D], normalized.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_exp.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

using pagedjax::fast_exp;
using pagedjax::run_parallel;

constexpr int kMaxGroup = 16;  // query heads per KV head
constexpr int kMaxBlock = 64;  // tokens per cache block
constexpr int kMaxSplits = 32;  // ranges a sequence's own blocks split into at small batches

struct Problem {
  const float* q;
  const float* k;   // float caches, or nullptr when the cache is int8:
  const float* v;
  const int8_t* k8;  // int8 values [NB, BS, H, D] and
  const int8_t* v8;
  const uint16_t* ks;  // their float16 scales and zeros [NB, BS, H, QG]
  const uint16_t* vs;
  const uint16_t* kz;
  const uint16_t* vz;
  int64_t KQG, VQG;     // scale groups per token and head of K and of V (D / QG channels each)
  const int32_t* lens;
  const int32_t* tables;
  const int32_t* shared_blocks;  // [MB] the prefix blocks every member holds
  const int32_t* suffix_start;   // [S] = shared_len for members, 0 for the others
  int64_t shared_len;            // tokens (whole blocks); 0 = no cascade
  float* out;
  float* state;                  // [S, H, G, 2 + D]: m, l, acc of the cascade, per query row
  int64_t S, H, G, BS, MB;
  // Prefill (PagedjaxPrefillAttention): S counts query tokens, not sequences; token t belongs to
  // table row seq_of[t] and sits at position pos[t] (-1: not this kernel's token, output 0).
  const int32_t* seq_of = nullptr;
  const int32_t* pos = nullptr;
  int64_t window = 0;  // 0: full attention; else keys k with p - window < k <= p (sliding window)
};

// float16 bits -> float (an int8 cache's scales and zeros).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while ((man & 0x400u) == 0) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// The first key position a query at position `qpos` sees (0 without a window).
inline int64_t window_start(const Problem& p, int64_t qpos) {
  return p.window > 0 ? std::max<int64_t>(0, qpos - p.window + 1) : 0;
}

// A cascade / decode row's query position: its token's in prefill, its sequence's last in decode.
inline int64_t row_position(const Problem& p, int64_t row) {
  return p.pos != nullptr ? p.pos[row / p.G] : p.lens[row / p.G] - 1;
}

// Decode: the first of sequence s's own blocks it reads (after the cascade's, inside the window).
inline int64_t first_own_block(const Problem& p, int64_t s) {
  return std::max<int64_t>(p.suffix_start[s] / p.BS, window_start(p, p.lens[s] - 1) / p.BS);
}

#if defined(__AVX512F__)
#include <immintrin.h>

// sc[t][r] = sum_i qT[i][r] * k_t[i] for the BS tokens of one block: 8 tokens at a time so 8
// independent FMA chains hide the FMA latency; the key element is broadcast from memory.
template <int D>
inline void block_scores(const float (*qT)[16], const float* kb, int64_t tok, int64_t BS, float (*sc)[16]) {
  for (int64_t t0 = 0; t0 < BS; t0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    for (int i = 0; i < D; ++i) {
      const __m512 qv = _mm512_load_ps(qT[i]);
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kb[(t0 + j) * tok + i]), acc[j]);
    }
    for (int j = 0; j < 8; ++j) _mm512_store_ps(sc[t0 + j], acc[j]);
  }
}

// A[r] = A[r] * alpha[r] + sum_t p[t][r] * v_t, two rows at a time (2 x D/16 FMA chains).
template <int D>
inline void block_values(float (*A)[D], int64_t nrows, const float* alpha, const float (*sc)[16], const float* vb,
                         int64_t tok, int64_t BS) {
  constexpr int C = D / 16;
  for (int64_t r = 0; r < nrows; r += 2) {
    const int64_t r1 = std::min<int64_t>(r + 1, nrows - 1);
    __m512 a0[C], a1[C];
    const __m512 al0 = _mm512_set1_ps(alpha[r]), al1 = _mm512_set1_ps(alpha[r1]);
    for (int c = 0; c < C; ++c) {
      a0[c] = _mm512_mul_ps(_mm512_loadu_ps(A[r] + 16 * c), al0);
      a1[c] = _mm512_mul_ps(_mm512_loadu_ps(A[r1] + 16 * c), al1);
    }
    for (int64_t t = 0; t < BS; ++t) {
      const float* vt = vb + t * tok;
      const __m512 w0 = _mm512_set1_ps(sc[t][r]), w1 = _mm512_set1_ps(sc[t][r1]);
      for (int c = 0; c < C; ++c) {
        const __m512 v = _mm512_loadu_ps(vt + 16 * c);
        a0[c] = _mm512_fmadd_ps(w0, v, a0[c]);
        a1[c] = _mm512_fmadd_ps(w1, v, a1[c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      _mm512_storeu_ps(A[r1] + 16 * c, a1[c]);  // r1 first: when r1 == r, a0 (the real row) wins
      _mm512_storeu_ps(A[r] + 16 * c, a0[c]);
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// AVX2 without AVX-512 (e.g. AMD Zen 2/3): the same 16-row tiles as two 8-lane halves. Without
// this path the step fell back to the scalar loops: 184 ms of attention per 64-row SmolLM2
// decode step on a 2-core Zen 3 EPYC, slower than XLA's 117 ms.

// sc[t][r] as above: 4 tokens x 2 halves = 8 independent FMA chains (Zen 3: 2 pipes x 4 cycles).
template <int D>
inline void block_scores(const float (*qT)[16], const float* kb, int64_t tok, int64_t BS, float (*sc)[16]) {
  for (int64_t t0 = 0; t0 < BS; t0 += 4) {
    __m256 acc[4][2];
    for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int i = 0; i < D; ++i) {
      const __m256 q0 = _mm256_load_ps(qT[i]), q1 = _mm256_load_ps(qT[i] + 8);
      for (int j = 0; j < 4; ++j) {
        const __m256 k = _mm256_broadcast_ss(kb + (t0 + j) * tok + i);
        acc[j][0] = _mm256_fmadd_ps(q0, k, acc[j][0]);
        acc[j][1] = _mm256_fmadd_ps(q1, k, acc[j][1]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      _mm256_store_ps(sc[t0 + j], acc[j][0]);
      _mm256_store_ps(sc[t0 + j] + 8, acc[j][1]);
    }
  }
}

// A[r] = A[r] * alpha[r] + sum_t p[t][r] * v_t, one row and up to 64 columns (8 chains) a pass.
template <int D>
inline void block_values(float (*A)[D], int64_t nrows, const float* alpha, const float (*sc)[16], const float* vb,
                         int64_t tok, int64_t BS) {
  constexpr int C = D / 8, W = C < 8 ? C : 8;
  for (int64_t r = 0; r < nrows; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int c0 = 0; c0 < C; c0 += W) {
      __m256 a[W];
      for (int c = 0; c < W; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(A[r] + 8 * (c0 + c)), al);
      for (int64_t t = 0; t < BS; ++t) {
        const float* vt = vb + t * tok + 8 * c0;
        const __m256 w = _mm256_set1_ps(sc[t][r]);
        for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * c), a[c]);
      }
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(A[r] + 8 * (c0 + c), a[c]);
    }
  }
}
#else
template <int D>
inline void block_scores(const float (*qT)[16], const float* kb, int64_t tok, int64_t BS, float (*sc)[16]) {
  for (int64_t t = 0; t < BS; ++t) {
    const float* kt = kb + t * tok;
    float acc[16] = {0};
    for (int i = 0; i < D; ++i)
      for (int r = 0; r < 16; ++r) acc[r] += qT[i][r] * kt[i];
    for (int r = 0; r < 16; ++r) sc[t][r] = acc[r];
  }
}

template <int D>
inline void block_values(float (*A)[D], int64_t nrows, const float* alpha, const float (*sc)[16], const float* vb,
                         int64_t tok, int64_t BS) {
  for (int64_t r = 0; r < nrows; ++r) {
    for (int i = 0; i < D; ++i) A[r][i] *= alpha[r];
    for (int64_t t = 0; t < BS; ++t)
      for (int i = 0; i < D; ++i) A[r][i] += sc[t][r] * vb[t * tok + i];
  }
}
#endif

// One token's head of an int8 cache: `groups` runs of D / groups values, each value * scale + zero.
inline void dequantize_row(const int8_t* q, const uint16_t* scale, const uint16_t* zero, int64_t groups, int64_t D,
                           float* out) {
  const int64_t W = D / groups;
#if defined(__AVX512F__)
  // 16 values per instruction, each lane's scale and zero picked from up to 32 groups by a
  // two-register permute (a group of 8 channels is half a vector: a loop per group ran the
  // batch-64 decode's attention at 2.5x the old per-head layout's time).
  if (groups <= 32 && D % 16 == 0 && (W & (W - 1)) == 0) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __mmask16 m0 = static_cast<__mmask16>((1u << std::min<int64_t>(groups, 16)) - 1);
    const __mmask16 m1 = static_cast<__mmask16>(groups > 16 ? (1u << (groups - 16)) - 1 : 0);
    const __m512 s0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, scale));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, scale + 16));
    const __m512 z0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m0, zero));
    const __m512 z1 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m1, zero + 16));
#else
    alignas(64) float s[32] = {}, z[32] = {};
    for (int64_t g = 0; g < groups; ++g) {
      s[g] = half_to_float(scale[g]);
      z[g] = half_to_float(zero[g]);
    }
    const __m512 s0 = _mm512_load_ps(s), s1 = _mm512_load_ps(s + 16);
    const __m512 z0 = _mm512_load_ps(z), z1 = _mm512_load_ps(z + 16);
#endif
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i shift = _mm_cvtsi32_si128(__builtin_ctzll(static_cast<unsigned long long>(W)));
    for (int64_t c = 0; c < D; c += 16) {
      const __m512i idx = _mm512_srl_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(c)), iota), shift);
      const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c))));
      _mm512_storeu_ps(out + c, _mm512_fmadd_ps(x, _mm512_permutex2var_ps(s0, idx, s1),
                                                _mm512_permutex2var_ps(z0, idx, z1)));
    }
    return;
  }
#endif
  for (int64_t g = 0; g < groups; ++g) {
    const float s = half_to_float(scale[g]), z = half_to_float(zero[g]);
#pragma omp simd
    for (int64_t i = 0; i < W; ++i) out[g * W + i] = static_cast<float>(q[g * W + i]) * s + z;
  }
}

// The K and V rows of one block and head as float rows `stride` apart: the cache itself for
// a float cache; for int8, dequantized once into `kf`/`vf` (shared by every row that reads
// the block next).
template <int D>
inline int64_t block_rows(const Problem& p, int64_t blk, int64_t h, float* kf, float* vf, const float** kb,
                          const float** vb) {
  const int64_t H = p.H, BS = p.BS;
  if (p.k8 == nullptr) {
    *kb = p.k + (blk * BS * H + h) * D;
    *vb = p.v + (blk * BS * H + h) * D;
    return H * D;
  }
  for (int64_t t = 0; t < BS; ++t) {
    const int64_t slot = (blk * BS + t) * H + h;
    dequantize_row(p.k8 + slot * D, p.ks + slot * p.KQG, p.kz + slot * p.KQG, p.KQG, D, kf + t * D);
    dequantize_row(p.v8 + slot * D, p.vs + slot * p.VQG, p.vz + slot * p.VQG, p.VQG, D, vf + t * D);
  }
  *kb = kf;
  *vb = vf;
  return D;
}

// One block's online-softmax update for 16 rows: scores sc[t][r] (-inf = masked) become
// weights; m, l rescale by alpha (returned per row for the accumulators).
#if defined(__AVX512F__)
// exp(x) for 16 lanes, x <= 0 or -inf (-> 0): cpu_exp.h's exp_ps, masked (GCC
// does not vectorize the scalar loops over the [t][16] tiles: scalar exps were ~half the
// cascade's time).
inline __m512 exp16(__m512 x) {
  const __mmask16 masked = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~masked), pagedjax::exp_ps(x));
}

inline void block_softmax(float (*sc)[16], int64_t BS, float* m, float* l, float* alpha) {
  const __m512 m0 = _mm512_loadu_ps(m);
  __m512 mx = m0;
  for (int64_t t = 0; t < BS; ++t) mx = _mm512_max_ps(mx, _mm512_load_ps(sc[t]));
  // alpha = exp(m - mx), 0 where m is still -inf (nothing seen yet; avoids -inf - -inf)
  const __mmask16 seen = _mm512_cmp_ps_mask(m0, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  const __m512 al = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(m0, mx)));
  __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(l), al);
  const __mmask16 any = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  for (int64_t t = 0; t < BS; ++t) {  // rows that saw nothing yet keep weight 0 (no -inf - -inf)
    const __m512 e = _mm512_maskz_mov_ps(any, exp16(_mm512_sub_ps(_mm512_load_ps(sc[t]), mx)));
    _mm512_store_ps(sc[t], e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(alpha, al);
  _mm512_storeu_ps(l, sum);
  _mm512_storeu_ps(m, mx);
}
#elif defined(__AVX2__) && defined(__FMA__)
// exp(x) for 8 lanes, x <= 0 or -inf (-> 0): as exp16.
inline __m256 exp8(__m256 x) {
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
  return _mm256_andnot_ps(masked, pagedjax::exp_ps(x));
}

inline void block_softmax(float (*sc)[16], int64_t BS, float* m, float* l, float* alpha) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int h = 0; h < 16; h += 8) {
    const __m256 m0 = _mm256_loadu_ps(m + h);
    __m256 mx = m0;
    for (int64_t t = 0; t < BS; ++t) mx = _mm256_max_ps(mx, _mm256_load_ps(sc[t] + h));
    const __m256 seen = _mm256_cmp_ps(m0, ninf, _CMP_NEQ_OQ);  // as block_softmax above
    const __m256 al = _mm256_and_ps(seen, exp8(_mm256_sub_ps(m0, mx)));
    __m256 sum = _mm256_mul_ps(_mm256_loadu_ps(l + h), al);
    const __m256 any = _mm256_cmp_ps(mx, ninf, _CMP_NEQ_OQ);
    for (int64_t t = 0; t < BS; ++t) {
      const __m256 e = _mm256_and_ps(any, exp8(_mm256_sub_ps(_mm256_load_ps(sc[t] + h), mx)));
      _mm256_store_ps(sc[t] + h, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(alpha + h, al);
    _mm256_storeu_ps(l + h, sum);
    _mm256_storeu_ps(m + h, mx);
  }
}
#else
inline void block_softmax(float (*sc)[16], int64_t BS, float* m, float* l, float* alpha) {
  float mx[16];
  for (int r = 0; r < 16; ++r) mx[r] = m[r];
  for (int64_t t = 0; t < BS; ++t)
    for (int r = 0; r < 16; ++r) mx[r] = std::max(mx[r], sc[t][r]);
  for (int r = 0; r < 16; ++r) {
    alpha[r] = m[r] == -INFINITY ? 0.0f : fast_exp(m[r] - mx[r]);
    l[r] *= alpha[r];
    m[r] = mx[r];
  }
  for (int64_t t = 0; t < BS; ++t)
    for (int r = 0; r < 16; ++r) {
      sc[t][r] = sc[t][r] == -INFINITY ? 0.0f : fast_exp(sc[t][r] - mx[r]);
      l[r] += sc[t][r];
    }
}
#endif

// Phase 1 (cascade): one KV head, 16 query rows (member sequence, group) at a time against
// the shared prefix. Each K/V block is read once for 16 rows instead of once per sequence,
// and the products run across rows: 16 rows' scores for a token are one vector FMA chain
// with the key's elements broadcast (no horizontal sums).
template <int D>
void shared_rows(const Problem& p, int64_t h, const int64_t* rows, int64_t nrows) {
  const int64_t H = p.H, G = p.G, BS = p.BS;
  alignas(64) float kf[kMaxBlock * D], vf[kMaxBlock * D];  // int8 caches: this block, dequantized
  alignas(64) float qT[D][16];
  for (int i = 0; i < D; ++i)
    for (int r = 0; r < 16; ++r) {
      const int64_t row = rows[std::min<int64_t>(r, nrows - 1)];  // row = s * G + g
      qT[i][r] = p.q[((row / G) * H + h) * G * D + (row % G) * D + i];
    }
  alignas(64) float m[16], l[16], A[16][D];
  int64_t lo[16], lowest = INT64_MAX, highest = 0;  // each row's window start (rows sit after the prefix)
  for (int r = 0; r < 16; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int i = 0; i < D; ++i) A[r][i] = 0.0f;
    lo[r] = window_start(p, row_position(p, rows[std::min<int64_t>(r, nrows - 1)]));
    lowest = std::min(lowest, lo[r]);
    highest = std::max(highest, lo[r]);
  }
  const int64_t nblocks = p.shared_len / BS;
  for (int64_t b = lowest / BS; b < nblocks; ++b) {  // blocks before every row's window: skipped
    const float *kb, *vb;
    const int64_t ts = block_rows<D>(p, p.shared_blocks[b], h, kf, vf, &kb, &vb);
    alignas(64) float sc[kMaxBlock][16];
    block_scores<D>(qT, kb, ts, BS, sc);
    if (b * BS < highest)  // some row's window starts after this block's first token
      for (int64_t t = 0; t < BS; ++t)
        for (int r = 0; r < 16; ++r)
          if (b * BS + t < lo[r]) sc[t][r] = -INFINITY;
    alignas(64) float alpha[16];
    block_softmax(sc, BS, m, l, alpha);
    block_values<D>(A, nrows, alpha, sc, vb, ts, BS);
  }
  for (int r = 0; r < nrows; ++r) {
    const int64_t row = rows[r];
    float* st = p.state + (((row / G) * H + h) * G + row % G) * (2 + D);
    st[0] = m[r];
    st[1] = l[r];
    for (int i = 0; i < D; ++i) st[2 + i] = A[r][i];
  }
}

// Prefill phase 2: up to 16 rows = `nt` consecutive tokens (all groups) of one sequence and one
// KV head, against that sequence's own blocks after the cascade's, each row causal up to its
// token's position. The shared-prefix partials (phase 1) seed member rows.
template <int D>
void token_tile(const Problem& p, int64_t t0, int64_t nt, int64_t h) {
  const int64_t H = p.H, G = p.G, BS = p.BS, nrows = nt * G;
  const int64_t s = p.seq_of[t0];
  alignas(64) float kf[kMaxBlock * D], vf[kMaxBlock * D];
  alignas(64) float qT[D][16], m[16], l[16], A[16][D], alpha[16];
  int32_t lim[16];
  int64_t lo[16];  // each row's window start
  const bool member = p.suffix_start[s] > 0;
  for (int r = 0; r < 16; ++r) {
    const int64_t rr = std::min<int64_t>(r, nrows - 1), t = t0 + rr / G, g = rr % G;
    lim[r] = p.pos[t];
    lo[r] = window_start(p, p.pos[t]);
    for (int i = 0; i < D; ++i) qT[i][r] = p.q[(t * H + h) * G * D + g * D + i];
    if (member) {  // (state exists only when there is a shared prefix)
      const float* st = p.state + ((t * H + h) * G + g) * (2 + D);
      m[r] = st[0];
      l[r] = st[1];
      for (int i = 0; i < D; ++i) A[r][i] = st[2 + i];
    } else {
      m[r] = -INFINITY;
      l[r] = 0.0f;
      for (int i = 0; i < D; ++i) A[r][i] = 0.0f;
    }
  }
  const int32_t* table = p.tables + s * p.MB;
  const int64_t last = p.pos[t0 + nt - 1] / BS;  // tokens ascend: the tile's last sees the most
  const int64_t first = std::max<int64_t>(p.suffix_start[s] / BS, window_start(p, p.pos[t0]) / BS);  // and the first
  for (int64_t b = first; b <= last; ++b) {
    const float *kb, *vb;
    const int64_t ts = block_rows<D>(p, table[b], h, kf, vf, &kb, &vb);
    alignas(64) float sc[kMaxBlock][16];
    block_scores<D>(qT, kb, ts, BS, sc);
    for (int64_t t = 0; t < BS; ++t)
      for (int r = 0; r < 16; ++r)
        if (b * BS + t > lim[r] || b * BS + t < lo[r]) sc[t][r] = -INFINITY;
    block_softmax(sc, BS, m, l, alpha);
    block_values<D>(A, nrows, alpha, sc, vb, ts, BS);
  }
  for (int64_t r = 0; r < nrows; ++r) {
    const float inv = 1.0f / std::max(l[r], 1e-30f);
    float* o = p.out + ((t0 + r / G) * H + h) * G * D + (r % G) * D;
#pragma omp simd
    for (int i = 0; i < D; ++i) o[i] = A[r][i] * inv;
  }
}

#if defined(__AVX512F__)
// Lane L of the result = the sum of v[kSlot[L]]'s 16 lanes: 16 dot products' partial vectors
// reduced together by a transpose-add tree (15 shuffle pairs) instead of 16 horizontal sums.
constexpr int kSlot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

inline __m512 hsum16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: 8 partials of v[i]; 8-15: of v[i + 8]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit blocks: 4 partials of v[i], v[i + 8], v[i + 4], v[i + 12]
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // per block: 2 partials of x[i]'s vector, then 2 of x[i + 2]'s
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44), _mm512_shuffle_ps(x[i], x[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
}

// Decode phase 2 for one sequence, KV head and own block b: its G query rows against the
// block's tokens, 16 at a time (own_ranges walks the blocks). A sequence has only G (~3) rows, too few for the cascade's row-lane
// tiles, so here the lanes run over tokens: each row's 16 scores come out as one vector
// (hsum16), its softmax update is vector-wide, and the accumulators stay in registers while
// the tile's V rows stream past.
template <int D>
void own_head(const Problem& p, int64_t s, int64_t h, float* m, float* l, float (*acc)[D], int64_t b) {
  constexpr int C = D / 16;
  const int64_t G = p.G, BS = p.BS, len = p.lens[s];
  const int32_t* table = p.tables + s * p.MB;
  const float* q = p.q + (s * p.H + h) * G * D;
  alignas(64) float kf[kMaxBlock * D], vf[kMaxBlock * D];
  alignas(64) float e[16];
  if (b * BS >= len) return;
  {
    const int64_t n = std::min<int64_t>(BS, len - b * BS);
    const int64_t skip = window_start(p, len - 1) - b * BS;  // tokens of this block before the window
    const float *kb, *vb;
    const int64_t ts = block_rows<D>(p, table[b], h, kf, vf, &kb, &vb);
    for (int64_t t0 = skip > 0 ? skip / 16 * 16 : 0; t0 < n; t0 += 16) {  // (every tile sees a token)
      const int64_t nt = std::min<int64_t>(16, n - t0);
      const uint32_t before = skip > t0 ? (1u << (skip - t0)) - 1 : 0u;
      const __mmask16 valid = static_cast<__mmask16>(((1u << nt) - 1) & ~before);
      for (int64_t g = 0; g < G; ++g) {
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + g * D + 16 * c);
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          __m512 a = _mm512_setzero_ps();
          if (j < nt) {
            const float* kt = kb + (t0 + j) * ts;
            for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kt + 16 * c), a);
          }
          part[kSlot[j]] = a;
        }
        const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, hsum16(part));
        const float mx = std::max(m[g], _mm512_reduce_max_ps(sc));
        const float alpha = m[g] == -INFINITY ? 0.0f : fast_exp(m[g] - mx);
        const __m512 w = exp16(_mm512_sub_ps(sc, _mm512_set1_ps(mx)));  // masked lanes: exp(-inf) = 0
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(w);
        m[g] = mx;
        _mm512_store_ps(e, w);
        __m512 a[C];
        const __m512 al = _mm512_set1_ps(alpha);
        for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + 16 * c), al);
        for (int64_t j = 0; j < nt; ++j) {
          const float* vt = vb + (t0 + j) * ts;
          const __m512 wj = _mm512_set1_ps(e[j]);
          for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vt + 16 * c), a[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[g] + 16 * c, a[c]);
      }
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// Lane i = the sum of v_i's 8 lanes, for 4 vectors at once (two hadd levels, one cross-half add).
inline __m128 hsum4(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hadd8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// own_head above with 8 tokens a tile: 8 dot products (4 at a time, hsum4) give the row's 8
// scores as one vector.
template <int D>
void own_head(const Problem& p, int64_t s, int64_t h, float* m, float* l, float (*acc)[D], int64_t b) {
  constexpr int C = D / 8;
  const int64_t G = p.G, BS = p.BS, len = p.lens[s];
  const int32_t* table = p.tables + s * p.MB;
  const float* q = p.q + (s * p.H + h) * G * D;
  alignas(64) float kf[kMaxBlock * D], vf[kMaxBlock * D];
  alignas(32) float e[8];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (b * BS >= len) return;
  {
    const int64_t n = std::min<int64_t>(BS, len - b * BS);
    const int64_t skip = window_start(p, len - 1) - b * BS;  // tokens of this block before the window
    const float *kb, *vb;
    const int64_t ts = block_rows<D>(p, table[b], h, kf, vf, &kb, &vb);
    for (int64_t t0 = skip > 0 ? skip / 8 * 8 : 0; t0 < n; t0 += 8) {  // (every tile sees a token)
      const int64_t nt = std::min<int64_t>(8, n - t0);
      const int first = static_cast<int>(std::max<int64_t>(0, skip - t0));  // lanes [first, nt) are visible
      const __m256 valid = _mm256_castsi256_ps(_mm256_and_si256(
          _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nt)), lane),
          _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(first - 1))));
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m128 half[2];
        for (int j0 = 0; j0 < 8; j0 += 4) {
          __m256 part[4];
          for (int j = 0; j < 4; ++j) {
            __m256 a = _mm256_setzero_ps();
            if (j0 + j < nt) {
              const float* kt = kb + (t0 + j0 + j) * ts;
              for (int c = 0; c < C; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kt + 8 * c), a);
            }
            part[j] = a;
          }
          half[j0 / 4] = hsum4(part[0], part[1], part[2], part[3]);
        }
        const __m256 sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_set_m128(half[1], half[0]), valid);
        const float mx = std::max(m[g], hmax8(sc));
        const float alpha = m[g] == -INFINITY ? 0.0f : fast_exp(m[g] - mx);
        const __m256 w = exp8(_mm256_sub_ps(sc, _mm256_set1_ps(mx)));  // masked lanes: exp(-inf) = 0
        l[g] = l[g] * alpha + hadd8(w);
        m[g] = mx;
        _mm256_store_ps(e, w);
        constexpr int W = C < 8 ? C : 8;
        const __m256 al = _mm256_set1_ps(alpha);
        for (int c0 = 0; c0 < C; c0 += W) {
          __m256 a[W];
          for (int c = 0; c < W; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + 8 * (c0 + c)), al);
          for (int64_t j = 0; j < nt; ++j) {
            const float* vt = vb + (t0 + j) * ts + 8 * c0;
            const __m256 wj = _mm256_set1_ps(e[j]);
            for (int c = 0; c < W; ++c) a[c] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vt + 8 * c), a[c]);
          }
          for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc[g] + 8 * (c0 + c), a[c]);
        }
      }
    }
  }
}
#endif

// Phase 2 (decode) where own_ranges does not serve (no AVX2, or a head dim not a multiple of
// 16): sequence s's own blocks for KV head h, one work item, in plain loops.
template <int D>
void one_head(const Problem& p, int64_t s, int64_t h) {
  const int64_t H = p.H, G = p.G, BS = p.BS;
  float* out = p.out + s * H * G * D;
  const int32_t len = p.lens[s];
  if (len <= 0) {
    std::fill(out + h * G * D, out + (h + 1) * G * D, 0.0f);
    return;
  }
  const int32_t* table = p.tables + s * p.MB;
  alignas(64) float kf[kMaxBlock * D], vf[kMaxBlock * D];  // int8 caches: this block, dequantized
  const int64_t nblocks = (len + BS - 1) / BS;
  const int64_t first = first_own_block(p, s);  // after the blocks the cascade covered, inside the window
  const int64_t lo = window_start(p, len - 1);
  alignas(64) float acc[kMaxGroup][D];
  alignas(64) float sc[kMaxGroup][kMaxBlock];
  float m[kMaxGroup], l[kMaxGroup];
  {
    const float* q = p.q + (s * H + h) * G * D;
    for (int64_t g = 0; g < G; ++g) {
      if (p.suffix_start[s] > 0) {
        const float* st = p.state + ((s * H + h) * G + g) * (2 + D);
        m[g] = st[0];
        l[g] = st[1];
        for (int i = 0; i < D; ++i) acc[g][i] = st[2 + i];
      } else {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int i = 0; i < D; ++i) acc[g][i] = 0.0f;
      }
    }
    for (int64_t b = first; b < nblocks; ++b) {
      const int64_t n = std::min<int64_t>(BS, len - b * BS);
      const int64_t t1 = std::max<int64_t>(0, lo - b * BS);  // tokens before the window: not read
      const float *kb, *vb;
      const int64_t ts = block_rows<D>(p, table[b], h, kf, vf, &kb, &vb);
      for (int64_t t = t1; t < n; ++t) {  // scores: each K row read once for the whole group
        const float* kt = kb + t * ts;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = q + g * D;
          float d = 0.0f;
#pragma omp simd reduction(+ : d)
          for (int i = 0; i < D; ++i) d += qg[i] * kt[i];
          sc[g][t] = d;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // online softmax over this block
        float mx = m[g];
        for (int64_t t = t1; t < n; ++t) mx = std::max(mx, sc[g][t]);
        const float alpha = m[g] == -INFINITY ? 0.0f : fast_exp(m[g] - mx);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = t1; t < n; ++t) {
          const float e = fast_exp(sc[g][t] - mx);
          sc[g][t] = e;
          sum += e;
        }
        l[g] = l[g] * alpha + sum;
        m[g] = mx;
        if (alpha != 1.0f) {
#pragma omp simd
          for (int i = 0; i < D; ++i) acc[g][i] *= alpha;
        }
      }
      for (int64_t t = t1; t < n; ++t) {  // values: each V row read once for the whole group
        const float* vt = vb + t * ts;
        for (int64_t g = 0; g < G; ++g) {
          const float w = sc[g][t];
#pragma omp simd
          for (int i = 0; i < D; ++i) acc[g][i] += w * vt[i];
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / std::max(l[g], 1e-30f);
      float* o = out + (h * G + g) * D;
#pragma omp simd
      for (int i = 0; i < D; ++i) o[i] = acc[g][i] * inv;
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Phase 2 (decode, vectorized builds): one item per sequence, or per range of its own blocks
// at a small batch. An item walks its blocks in order and, within a block, every KV head:
// the block's rows are read front to back (12 KB of K then of V for SmolLM2) instead of one
// head's 256-byte rows strided by the others', which left part of what DRAM and the
// prefetchers fetched unused (per-head items: 141 MB of own KV per 64-row step at ~15 GB/s).
// At a small batch (fewer than 4 sequences per core; batch 1 of SmolLM2: one item for 2
// cores) each sequence's own blocks split into ranges (flash-decoding) whose softmax
// partials one pass merges with the cascade's.
inline int64_t own_splits(const Problem& p, int64_t threads) {
  if (p.S >= 4 * threads) return 1;
  int64_t most = 0;
  for (int64_t s = 0; s < p.S; ++s)
    most = std::max<int64_t>(most, (p.lens[s] + p.BS - 1) / p.BS - first_own_block(p, s));
  const int64_t want = (4 * threads + p.S - 1) / p.S;
  return std::max<int64_t>(1, std::min<int64_t>({want, most / 2, kMaxSplits}));  // (2+ blocks a range)
}

// All K and V rows of block `blk` (every head) into L2: one block ahead of the walk.
inline void prefetch_block_all(const Problem& p, int64_t blk, int64_t D) {
  const int64_t bytes = p.BS * p.H * (p.k8 ? D : D * 4);
  const char* k = p.k8 ? reinterpret_cast<const char*>(p.k8) : reinterpret_cast<const char*>(p.k);
  const char* v = p.k8 ? reinterpret_cast<const char*>(p.v8) : reinterpret_cast<const char*>(p.v);
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(k + blk * bytes + o, 0, 2);
    __builtin_prefetch(v + blk * bytes + o, 0, 2);
  }
}

template <int D>
void own_ranges(ffi::ThreadPool& pool, int64_t threads, const Problem& p, int64_t splits) {
  const int64_t H = p.H, G = p.G, BS = p.BS, R = H * G;  // R: query rows of a sequence
  std::vector<float> part(splits > 1 ? static_cast<size_t>(p.S * splits * R * (2 + D)) : 0);
  run_parallel(pool, threads, p.S * splits, [&](int64_t i) {
    const int64_t s = i / splits, c = i % splits, len = p.lens[s];
    thread_local std::vector<float> st;  // m, l, acc of each row: [R][2 + D]
    st.resize(static_cast<size_t>(R * (2 + D)));
    const bool seed = splits == 1 && p.suffix_start[s] > 0 && len > 0;  // (ranges merge it later)
    for (int64_t r = 0; r < R; ++r) {
      float* row = st.data() + r * (2 + D);
      if (seed) {
        std::copy(p.state + (s * R + r) * (2 + D), p.state + (s * R + r + 1) * (2 + D), row);
      } else {
        row[0] = -INFINITY;
        row[1] = 0.0f;
        std::fill(row + 2, row + 2 + D, 0.0f);
      }
    }
    if (len > 0) {
      const int64_t first = first_own_block(p, s), nblocks = (len + BS - 1) / BS;
      const int64_t per = (nblocks - first + splits - 1) / splits, b0 = first + c * per;
      const int64_t b1 = std::min(nblocks, b0 + per);
      const int32_t* table = p.tables + s * p.MB;
      for (int64_t b = b0; b < b1; ++b) {
        if (b + 1 < b1) prefetch_block_all(p, table[b + 1], D);
        for (int64_t h = 0; h < H; ++h) {
          alignas(64) float acc[kMaxGroup][D];
          float m[kMaxGroup], l[kMaxGroup];
          for (int64_t g = 0; g < G; ++g) {
            const float* row = st.data() + (h * G + g) * (2 + D);
            m[g] = row[0];
            l[g] = row[1];
            std::copy(row + 2, row + 2 + D, acc[g]);
          }
          own_head<D>(p, s, h, m, l, acc, b);
          for (int64_t g = 0; g < G; ++g) {
            float* row = st.data() + (h * G + g) * (2 + D);
            row[0] = m[g];
            row[1] = l[g];
            std::copy(acc[g], acc[g] + D, row + 2);
          }
        }
      }
    }
    if (splits > 1) {
      std::copy(st.begin(), st.end(), part.begin() + i * R * (2 + D));
      return;
    }
    for (int64_t r = 0; r < R; ++r) {
      const float* row = st.data() + r * (2 + D);
      float* o = p.out + (s * R + r) * D;
      const float inv = len > 0 ? 1.0f / std::max(row[1], 1e-30f) : 0.0f;
#pragma omp simd
      for (int j = 0; j < D; ++j) o[j] = row[2 + j] * inv;
    }
  });
  if (splits == 1) return;
  for (int64_t s = 0; s < p.S; ++s)
    for (int64_t r = 0; r < R; ++r) {
      float* o = p.out + (s * R + r) * D;
      if (p.lens[s] <= 0) {
        std::fill(o, o + D, 0.0f);
        continue;
      }
      // the partials to merge: the cascade's (members) and each range's
      const float* ps[kMaxSplits + 1];
      int64_t n = 0;
      if (p.suffix_start[s] > 0) ps[n++] = p.state + (s * R + r) * (2 + D);
      for (int64_t c = 0; c < splits; ++c) ps[n++] = part.data() + ((s * splits + c) * R + r) * (2 + D);
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, ps[j][0]);
      float l = 0.0f;
      alignas(64) float a[D] = {};
      for (int64_t j = 0; j < n; ++j) {
        if (ps[j][0] == -INFINITY) continue;  // a range past the sequence's end
        const float w = fast_exp(ps[j][0] - mx);
        l += ps[j][1] * w;
#pragma omp simd
        for (int k = 0; k < D; ++k) a[k] += ps[j][2 + k] * w;
      }
      const float inv = 1.0f / std::max(l, 1e-30f);
#pragma omp simd
      for (int k = 0; k < D; ++k) o[k] = a[k] * inv;
    }
}
#endif

// Phase 1 (both modes): member rows against the shared prefix, 16 rows and one head per item.
template <int D>
void cascade(ffi::ThreadPool& pool, int64_t threads, const Problem& p, const std::vector<int64_t>& rows) {
  const int64_t chunks = (static_cast<int64_t>(rows.size()) + 15) / 16;
  run_parallel(pool, threads, chunks * p.H, [&](int64_t i) {
    const int64_t h = i / chunks, c = i % chunks;
    shared_rows<D>(p, h, rows.data() + c * 16, std::min<int64_t>(16, rows.size() - c * 16));
  });
}

template <int D>
void run(ffi::ThreadPool& pool, int64_t threads, const Problem& p) {
  std::vector<int64_t> rows;
  if (p.pos == nullptr) {  // decode: one query token per sequence
    if (p.shared_len > 0)
      for (int64_t s = 0; s < p.S; ++s)
        if (p.suffix_start[s] > 0 && p.lens[s] > 0)
          for (int64_t g = 0; g < p.G; ++g) rows.push_back(s * p.G + g);
    if (!rows.empty()) cascade<D>(pool, threads, p, rows);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if constexpr (D % 16 == 0) return own_ranges<D>(pool, threads, p, own_splits(p, threads));
#endif
    run_parallel(pool, threads, p.S * p.H, [&](int64_t i) { one_head<D>(p, i / p.H, i % p.H); });  // phase 2
    return;
  }
  // prefill: tiles of consecutive tokens of one sequence (16 / G tokens: all 16 lanes busy)
  const int64_t per = std::max<int64_t>(1, 16 / p.G);
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t t = 0; t < p.S;) {
    if (p.pos[t] < 0) {
      std::fill(p.out + t * p.H * p.G * D, p.out + (t + 1) * p.H * p.G * D, 0.0f);
      ++t;
      continue;
    }
    const int64_t t0 = t;
    while (t < p.S && t - t0 < per && p.pos[t] >= 0 && p.seq_of[t] == p.seq_of[t0]) ++t;
    tiles.emplace_back(t0, t - t0);
    if (p.shared_len > 0 && p.suffix_start[p.seq_of[t0]] > 0)
      for (int64_t u = t0; u < t; ++u)
        for (int64_t g = 0; g < p.G; ++g) rows.push_back(u * p.G + g);
  }
  if (!rows.empty()) cascade<D>(pool, threads, p, rows);
  const int64_t n = static_cast<int64_t>(tiles.size());
  run_parallel(pool, threads, n * p.H, [&](int64_t i) {
    token_tile<D>(p, tiles[i % n].first, tiles[i % n].second, i / n);
  });
}

ffi::Error Decode(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Span<const int64_t> kd, const float* k,
                  const float* v, const int8_t* k8, const int8_t* v8, const uint16_t* ks, const uint16_t* vs,
                  const uint16_t* kz, const uint16_t* vz, int64_t KQG, int64_t VQG,
                  ffi::Buffer<ffi::S32>& kv_lens, ffi::Buffer<ffi::S32>& block_tables,
                  ffi::Buffer<ffi::S32>& shared_blocks, ffi::Buffer<ffi::S32>& shared_len,
                  ffi::Buffer<ffi::S32>& suffix_start, ffi::Buffer<ffi::S32>& seq_of, ffi::Buffer<ffi::S32>& pos,
                  ffi::Buffer<ffi::S32>& window, ffi::Result<ffi::Buffer<ffi::F32>>& out, int64_t num_threads) {
  const auto qd = q.dimensions();
  const auto td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q [S,H,G,D], caches [NB,BS,H,D], tables [S,MB]");
  }
  const int64_t S = qd[0], H = qd[1], G = qd[2], D = qd[3];
  const bool prefill = pos.element_count() > 0;
  if (kd[2] != H || kd[3] != D || G > kMaxGroup || kd[1] > kMaxBlock || kd[1] % 8 != 0 ||
      suffix_start.element_count() != static_cast<size_t>(td[0]) ||
      shared_blocks.element_count() < static_cast<size_t>(td[1]) || window.element_count() != 1 ||
      (prefill ? (pos.element_count() != static_cast<size_t>(S) || seq_of.element_count() != static_cast<size_t>(S))
               : td[0] != S)) {
    return ffi::Error::InvalidArgument("paged attention: shapes disagree or exceed the kernel's limits");
  }
  if (prefill) {  // a token must name a table row and fit its table (the kernel reads through it)
    for (int64_t t = 0; t < S; ++t) {
      const int32_t so = seq_of.typed_data()[t], ps = pos.typed_data()[t];
      if (ps >= 0 && (so < 0 || so >= td[0] || ps >= td[1] * kd[1])) {
        return ffi::Error::InvalidArgument("paged attention: a prefill token's sequence or position is out of range");
      }
    }
  }
  // Cascade partials, read only for member rows: none to allocate (and zero) without a shared
  // prefix (a fresh prefill step would otherwise clear ~1 MB per layer for nothing).
  const int64_t shared = shared_len.typed_data()[0];
  std::vector<float> state(shared > 0 ? static_cast<size_t>(S * H * G * (2 + D)) : 0);
  Problem p{q.typed_data(), k, v, k8, v8, ks, vs, kz, vz, KQG, VQG, kv_lens.typed_data(), block_tables.typed_data(),
            shared_blocks.typed_data(), suffix_start.typed_data(), shared, out->typed_data(), state.data(), S, H,
            G, kd[1], td[1]};
  if (prefill) {
    p.seq_of = seq_of.typed_data();
    p.pos = pos.typed_data();
  }
  p.window = std::max<int32_t>(0, window.typed_data()[0]);
  switch (D) {
    case 16: run<16>(pool, num_threads, p); break;
    case 32: run<32>(pool, num_threads, p); break;
    case 64: run<64>(pool, num_threads, p); break;
    case 128: run<128>(pool, num_threads, p); break;
    case 256: run<256>(pool, num_threads, p); break;  // Gemma 2/3
    default: return ffi::Error::InvalidArgument("paged attention: head_dim must be 16, 32, 64, 128 or 256");
  }
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> kv_lens,
                           ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> shared_blocks,
                           ffi::Buffer<ffi::S32> shared_len, ffi::Buffer<ffi::S32> suffix_start,
                           ffi::Buffer<ffi::S32> seq_of, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> window,
                           ffi::ResultBuffer<ffi::F32> out, int64_t num_threads) {
  return Decode(pool, q, k_cache.dimensions(), k_cache.typed_data(), v_cache.typed_data(), nullptr, nullptr,
                nullptr, nullptr, nullptr, nullptr, 1, 1, kv_lens, block_tables, shared_blocks, shared_len, suffix_start, seq_of, pos, window,
                out, num_threads);
}

// The same over an int8 cache (runtime.model.kv_pages.QuantizedPages): values, and float16 scales
// and zeros per slot, head and group of channels.
ffi::Error DecodeAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S8> k_cache,
                               ffi::Buffer<ffi::S8> v_cache, ffi::Buffer<ffi::F16> k_scale,
                               ffi::Buffer<ffi::F16> v_scale, ffi::Buffer<ffi::F16> k_zero,
                               ffi::Buffer<ffi::F16> v_zero, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> shared_blocks,
                               ffi::Buffer<ffi::S32> shared_len, ffi::Buffer<ffi::S32> suffix_start,
                               ffi::Buffer<ffi::S32> seq_of, ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> window,
                               ffi::ResultBuffer<ffi::F32> out, int64_t num_threads) {
  const auto cd = k_cache.dimensions(), ksd = k_scale.dimensions(), vsd = v_scale.dimensions();
  auto groups = [&](ffi::Span<const int64_t> sd) -> int64_t {  // QG, or 0 when the shape is wrong
    if (cd.size() != 4 || sd.size() != 4 || sd[0] != cd[0] || sd[1] != cd[1] || sd[2] != cd[2]) return 0;
    return sd[3] > 0 && cd[3] % sd[3] == 0 ? sd[3] : 0;
  };
  const int64_t KQG = groups(ksd), VQG = groups(vsd);
  if (KQG == 0 || VQG == 0 || v_cache.dimensions() != cd || k_zero.dimensions() != ksd ||
      v_zero.dimensions() != vsd) {
    return ffi::Error::InvalidArgument("paged attention: int8 caches [NB, BS, H, D] need scales and zeros [NB, BS, H, QG]"
                                       " with QG dividing D");
  }
  return Decode(pool, q, cd, nullptr, nullptr, k_cache.typed_data(), v_cache.typed_data(), k_scale.typed_data(),
                v_scale.typed_data(), k_zero.typed_data(), v_zero.typed_data(), KQG, VQG, kv_lens, block_tables, shared_blocks, shared_len,
                suffix_start, seq_of, pos, window, out, num_threads);
}

// The step's new K and V rows [T, H, D] into the float32 caches [NB, BS, H, D] at flat slots
// (block * BS + offset; out of range, e.g. -1 for padding: dropped), in place: each output
// aliases its cache (input_output_aliases). Why not XLA's scatter: with its out-of-range
// drop it became a dynamic-slice, a select, an update and copies per cache and layer (1.9 ms
// of a 26 ms batch-1 SmolLM2 step, each op a few microseconds of dispatch).
ffi::Error KvWrite(ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> k_out,
                   ffi::ResultBuffer<ffi::F32> v_out) {
  const auto cd = k_cache.dimensions(), kd = k.dimensions();
  if (cd.size() != 4 || kd.size() != 3 || v_cache.dimensions() != cd || v.dimensions() != kd || kd[1] != cd[2] ||
      kd[2] != cd[3] || slots.element_count() != static_cast<size_t>(kd[0])) {
    return ffi::Error::InvalidArgument("kv write: caches [NB,BS,H,D], rows [T,H,D], slots [T] disagree");
  }
  const int64_t n_slots = cd[0] * cd[1], row = cd[2] * cd[3];
  float *ko = k_out->typed_data(), *vo = v_out->typed_data();
  if (ko != k_cache.typed_data()) std::memcpy(ko, k_cache.typed_data(), k_cache.size_bytes());  // (not aliased)
  if (vo != v_cache.typed_data()) std::memcpy(vo, v_cache.typed_data(), v_cache.size_bytes());
  const int32_t* sl = slots.typed_data();
  for (int64_t t = 0; t < kd[0]; ++t) {
    if (sl[t] < 0 || sl[t] >= n_slots) continue;
    std::memcpy(ko + sl[t] * row, k.typed_data() + t * row, row * sizeof(float));
    std::memcpy(vo + sl[t] * row, v.typed_data() + t * row, row * sizeof(float));
  }
  return ffi::Error::Success();
}

}  // namespace

// The instruction-set path compiled into this build (runtime/kernels/cpu/build.py variants):
// "avx512", "avx2" (AVX2 + FMA) or "scalar".
extern "C" const char* PagedjaxAttentionPath() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "scalar";
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxKvWrite, KvWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_of (prefill; empty for decode)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [1] (0: full attention)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxDecodeAttentionInt8, DecodeAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()  // k_scale [NB, BS, H, QG]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // v_scale
                                  .Arg<ffi::Buffer<ffi::F16>>()  // k_zero
                                  .Arg<ffi::Buffer<ffi::F16>>()  // v_zero
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_of (prefill; empty for decode)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [1] (0: full attention)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("num_threads"));
