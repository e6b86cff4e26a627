// Kernels of the CPU runner (tt_moge/runners/fixed_graph.py), in the same native library as the host code:
//
// * moge_quantize_rows: float32/bfloat16 rows -> int8 with one scale per row (the activations of the int8 ViT
//   matmuls, optionally smoothed per column), one pass where torch needs six;
// * moge_dequantize: the int32 accumulators of those matmuls -> acc * row_scale * col_scale + bias in bfloat16 or
//   float32, one pass where torch needs five;
// * moge_attention_bf16: fused multi-head softmax attention in bfloat16 (AVX512-BF16 builds only; the two products
//   on AMX tiles where the CPU has them and the caller asks).
//
// The first two follow the torch reference (tt_moge/runners/cpu_kernels.py) operation for operation, so the
// results are bit-identical to it. Everything runs on its own thread pool (moge_runner_set_threads), apart from
// the host kernels' pool. (A native bfloat16 softmax alone was tried and dropped: ATen's was faster; fusing it
// between the two products is what pays.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MOGE_BF16_ATTENTION 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define MOGE_AMX_ATTENTION 1
#endif
// GCC 12's _mm512_max_ps and friends use a deliberately undefined pass-through operand that -Wall flags.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

moge::LazyPool g_runner_pool;  // the runner kernels' threads (apart from the host kernels')

moge::ThreadPool& runner_pool() { return g_runner_pool.get(); }

constexpr int kFloat32 = 0, kBFloat16 = 1;

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, NaN stays NaN (c10::BFloat16's conversion).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0x7FC0;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <typename T>
inline float load(const T* p, int64_t i);
template <>
inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <>
inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

constexpr int kLanes = 16;  // one AVX-512 register of floats: reductions in 16 independent lanes vectorize

// row[c] (times inv_smooth[c] when given), as float
template <typename T>
inline float smoothed(const T* row, const float* inv_smooth, int64_t c) {
  return inv_smooth ? load(row, c) * inv_smooth[c] : load(row, c);
}

// max |smoothed(row, c)| (exact whatever the order)
template <typename T>
inline float abs_max(const T* row, const float* inv_smooth, int64_t cols) {
  float lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= cols; c += kLanes)
    for (int k = 0; k < kLanes; ++k) lanes[k] = std::max(lanes[k], std::fabs(smoothed(row, inv_smooth, c + k)));
  float m = 0.0f;
  for (; c < cols; ++c) m = std::max(m, std::fabs(smoothed(row, inv_smooth, c)));
  for (int k = 0; k < kLanes; ++k) m = std::max(m, lanes[k]);
  return m;
}

// The per-row work is in plain functions of by-value arguments: inside a lambda, a store through an int8/uint16
// pointer could alias the captured sizes, which stops the compiler from vectorizing.
template <typename T>
void quantize_row(const T* row, const float* inv_smooth, int64_t cols, int8_t* out, float* scale_out) {
  // torch: xs = x.float() [* inv_smooth]; scale = xs.abs().amax(dim=1).clamp_min_(1e-12).div_(127);
  //        round(xs / scale).to(int8)
  const float scale = std::max(abs_max(row, inv_smooth, cols), 1e-12f) / 127.0f;
  *scale_out = scale;
  for (int64_t c = 0; c < cols; ++c) out[c] = static_cast<int8_t>(std::nearbyint(smoothed(row, inv_smooth, c) / scale));
}

template <typename T>
void quantize_rows(const T* x, const float* inv_smooth, int64_t rows, int64_t cols, int64_t ld, int8_t* out,
                   float* scales) {
  runner_pool().parallel_for(rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * ld, inv_smooth, cols, out + r * cols, scales + r);
  });
}

template <int OutType>
void dequantize_row(const int32_t* acc, int64_t cols, float row_scale, const float* col_scale, const float* bias,
                    float* tmp, void* out) {
  // torch: acc.float().mul_(row_scale).mul_(col_scale).add_(bias).to(dtype)
  for (int64_t c = 0; c < cols; ++c) tmp[c] = static_cast<float>(acc[c]) * row_scale * col_scale[c] + bias[c];
  if (OutType == kFloat32) {
    std::memcpy(out, tmp, cols * sizeof(float));
  } else {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t c = 0; c < cols; ++c) o[c] = float_to_bf16(tmp[c]);
  }
}

template <int OutType>
void dequantize(const int32_t* acc, int64_t rows, int64_t cols, const float* row_scale, const float* col_scale,
                const float* bias, void* out) {
  const int64_t out_size = OutType == kFloat32 ? 4 : 2;
  runner_pool().parallel_for(rows, 8, [=](int64_t r0, int64_t r1) {
    std::vector<float> tmp(cols);
    for (int64_t r = r0; r < r1; ++r)
      dequantize_row<OutType>(acc + r * cols, cols, row_scale[r], col_scale, bias, tmp.data(),
                              static_cast<char*>(out) + r * cols * out_size);
  });
}


#ifdef MOGE_BF16_ATTENTION
// ------------------------------------------------------------------------------------------ attention
// softmax(q k^T) v per head for one image, bfloat16 in and out, fused: the scores of 8 queries live in a
// per-thread buffer (8 x N float32, in L2) and never reach memory as a whole matrix. Products by AVX512-BF16
// dot products (vdpbf16ps: pairs of bfloat16 into float32), scores and sums in float32, probabilities rounded to
// bfloat16 for the second product (as the unfused bfloat16 path does), the output normalised in float32.
constexpr int kHeadDim = 64, kPairs = kHeadDim / 2, kRowBlock = 8, kKeyBlock = 32;

inline __m512 exp_ps(__m512 x) {  // exp(x) for x <= 0; below -87 -> ~0 (relative error < 2e-7 above)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]: 2^f by its Taylor series to degree 6
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

struct HeadScratch {
  std::vector<uint32_t> q, k, v;  // packed bfloat16 pairs
  std::vector<float> scores;      // kRowBlock x n_keys
  std::vector<uint16_t> probs;    // kRowBlock x n_keys
};

// r[j][p] -> r[p][j]: a 16 x 16 transpose of 32-bit elements (pairs within 128-bit lanes, then quads, then lanes)
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int j = 0; j < 16; j += 2) {
    t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {
    u[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
    u[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
    u[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
    u[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
  }
  // u[4g + k], lane L: column 4L + k of rows 4g ... 4g + 3
  for (int g = 0; g < 16; g += 8)
    for (int k = 0; k < 4; ++k) {
      t[g + k] = _mm512_shuffle_i32x4(u[g + k], u[g + 4 + k], 0x88);
      t[g + 4 + k] = _mm512_shuffle_i32x4(u[g + k], u[g + 4 + k], 0xdd);
    }
  // t[k], k < 8: lanes 0 and 2 column k's rows 0-3 and 4-7, lanes 1 and 3 column 8 + k's; t[8 + k]: rows 8-15
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(t[k], t[8 + k], 0xdd);
  }
}

// Pack one head. qkv: (n, ld) bfloat16 rows [q | k | v], this head's q at column q_col (k at q_col + c, v at
// q_col + 2c). q: per query its 32 pairs; k: per block of 16 keys, per pair, the 16 keys' pairs; v: per pair of
// keys, per dimension, the two keys' values (the even key in the low half). These are also the layouts AMX tiles
// read: q rows are A tiles, a block of 16 keys is a B tile (VNNI pairs), 32 keys of v are four B tiles.
void pack_head(const uint16_t* qkv, int64_t n, int64_t ld, int64_t c, int64_t q_col, int64_t nq, int64_t nk,
               HeadScratch& s) {
  // sized once per thread and shape; only the padding past the n real rows is cleared (the rest is written below):
  // padded keys are masked out of the softmax, but their values meet zero probabilities, and 0 x NaN is NaN
  s.q.resize(nq * kPairs);
  s.k.resize(nk * kPairs);
  s.v.resize(nk / 2 * kHeadDim);
  std::fill(s.q.begin() + n * kPairs, s.q.end(), 0u);
  std::fill(s.k.begin() + (n / 16) * 16 * kPairs, s.k.end(), 0u);  // from the first block with padded keys
  std::fill(s.v.begin() + (n + 1) / 2 * kHeadDim, s.v.end(), 0u);
  auto row = [=](int64_t i, int64_t col) { return reinterpret_cast<const uint32_t*>(qkv + i * ld + q_col + col); };
  for (int64_t i = 0; i < n; ++i) std::memcpy(&s.q[i * kPairs], row(i, 0), kPairs * 4);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // k: 16 keys' pairs, transposed 16 x 16 at a time
    for (int half = 0; half < 2; ++half) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(row(i + j, c) + 16 * half);
      transpose16(r);
      uint32_t* kb = &s.k[(i / 16) * kPairs * 16 + half * 16 * 16];
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kb + 16 * p, r[p]);
    }
  }
  for (; i < n; ++i) {  // the last keys, one by one
    uint32_t* kb = &s.k[(i / 16) * kPairs * 16 + (i % 16)];
    for (int p = 0; p < kPairs; ++p) kb[p * 16] = row(i, c)[p];
  }
  for (int64_t j = 0; j < n; j += 2) {  // v: two keys' values interleaved, the even key in the low half
    const uint16_t* v0 = qkv + j * ld + q_col + 2 * c;
    uint32_t* vb = &s.v[(j / 2) * kHeadDim];
    for (int d = 0; d < kHeadDim; d += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + d)));
      const __m512i hi = j + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + ld + d)))
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(vb + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// One row's softmax numerators exp(score - max), rounded to bfloat16, over its n real keys (the nk - n padded
// ones get 0); returns 1 / their sum (of the float32 numerators).
inline float softmax_row(const float* row, uint16_t* prow, int64_t n, int64_t nk) {
  const int64_t full = n / 16, rem = n % 16;  // 16-key chunks with only real keys; real keys in the next one
  const __mmask16 tail = static_cast<__mmask16>((1u << rem) - 1u);
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (int64_t q = 0; q < full; ++q) m = _mm512_max_ps(m, _mm512_loadu_ps(row + 16 * q));
  if (rem) m = _mm512_mask_max_ps(m, tail, m, _mm512_loadu_ps(row + 16 * full));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t q = 0; q < nk / 16; ++q) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + 16 * q), mx));
    if (q >= full) e = _mm512_maskz_mov_ps(q == full ? tail : 0, e);  // padded keys: 0 (tail is 0 if rem is)
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + 16 * q), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// One output row: acc (64 float32) * inv_sum -> 64 bfloat16
inline void store_row(const float* acc, float inv_sum, uint16_t* o) {
  const __m512 scale = _mm512_set1_ps(inv_sum);
  for (int d = 0; d < 4; ++d)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * d),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + 16 * d), scale))));
}

// One head by AVX512-BF16 dot products. out: (n, out_ld) bfloat16, this head's 64 columns at out_col.
void attention_head(const uint16_t* qkv, int64_t n, int64_t ld, int64_t c, int64_t q_col, uint16_t* out,
                    int64_t out_ld, int64_t out_col, HeadScratch& s) {
  const int64_t nq = (n + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t nk = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  pack_head(qkv, n, ld, c, q_col, nq, nk, s);
  s.scores.resize(kRowBlock * nk);
  s.probs.resize(kRowBlock * nk);
  float* scores = s.scores.data();
  uint16_t* probs = s.probs.data();
  for (int64_t i0 = 0; i0 < nq; i0 += kRowBlock) {
    // scores = q k^T for 8 queries x all keys
    const uint32_t* qb = &s.q[i0 * kPairs];
    for (int64_t j0 = 0; j0 < nk; j0 += kKeyBlock) {
      __m512 acc[kRowBlock][2];
      for (int r = 0; r < kRowBlock; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      const uint32_t* k0 = &s.k[(j0 / 16) * kPairs * 16];
      const uint32_t* k1 = k0 + kPairs * 16;
      for (int p = 0; p < kPairs; ++p) {
        const __m512bh b0 = as_bh(_mm512_loadu_si512(k0 + p * 16));
        const __m512bh b1 = as_bh(_mm512_loadu_si512(k1 + p * 16));
        for (int r = 0; r < kRowBlock; ++r) {
          const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(qb[r * kPairs + p])));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
      }
      for (int r = 0; r < kRowBlock; ++r) {
        _mm512_storeu_ps(scores + r * nk + j0, acc[r][0]);
        _mm512_storeu_ps(scores + r * nk + j0 + 16, acc[r][1]);
      }
    }
    float inv_sum[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) inv_sum[r] = softmax_row(scores + r * nk, probs + r * nk, n, nk);
    // out = (p v) / sum, 4 queries at a time
    for (int g = 0; g < kRowBlock; g += 4) {
      __m512 acc[4][4];
      for (int r = 0; r < 4; ++r)
        for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_setzero_ps();
      const uint32_t* prows = reinterpret_cast<const uint32_t*>(probs + g * nk);
      const int64_t pstride = nk / 2;
      for (int64_t kp = 0; kp < nk / 2; ++kp) {
        const uint32_t* vb = &s.v[kp * kHeadDim];
        const __m512bh b0 = as_bh(_mm512_loadu_si512(vb)), b1 = as_bh(_mm512_loadu_si512(vb + 16));
        const __m512bh b2 = as_bh(_mm512_loadu_si512(vb + 32)), b3 = as_bh(_mm512_loadu_si512(vb + 48));
        for (int r = 0; r < 4; ++r) {
          const __m512bh a = as_bh(_mm512_set1_epi32(static_cast<int>(prows[r * pstride + kp])));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
        }
      }
      for (int r = 0; r < 4; ++r) {
        const int64_t i = i0 + g + r;
        if (i >= n) break;
        float row[kHeadDim];
        for (int d = 0; d < 4; ++d) _mm512_storeu_ps(row + 16 * d, acc[r][d]);
        store_row(row, inv_sum[g + r], out + i * out_ld + out_col);
      }
    }
  }
}

#ifdef MOGE_AMX_ATTENTION
// The same head with both products on AMX tiles (TDPBF16PS: a 16 x 32 bfloat16 tile times a 32 x 16 one into
// 16 x 16 float32) and the softmax between them on AVX-512, flash-attention style: 32 queries at a time walk the
// keys 64 at a time, with a running maximum and sum per query, so that the scores, probabilities and output of
// the block stay in L1 (8 + 4 + 8 KB) and only k and v stream from L2. Every tile is 16 rows of 64 bytes:
// q k^T in 32 x 32 quarters (tiles 0-3 the scores, 4-5 q, 6-7 k), p v 16 queries x 64 dimensions at a time (tiles
// 0-3 the output, 4 p, 5-7 v). The caller has configured the tiles (configure_tiles).
constexpr int kFlashRows = 32, kFlashKeys = 64, kKeyVecs = kFlashKeys / 16;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Linux gives a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// 2^t for t <= 0 (t = -inf gives NaN: the caller masks those lanes): a near-minimax polynomial of degree 3 for 2^f
// on [-1/2, 1/2] (relative error 7.5e-5, fifty times below the bfloat16 rounding of the probabilities that follows;
// degree 4, 2.6e-6, was 5-9 % slower over the whole kernel on the AMX Xeon).
inline __m512 exp2_ps(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(5.516974627971649e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260665476322174e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.932609677314758e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999284744262695e-1f));
  return _mm512_scalef_ps(p, n);  // 0 below 2^-149
}

// The softmax step of one 32-query x 64-key block: for each query, a new maximum rescales its output and sum so
// far; the block's numerators exp(score - max) go to probs (bfloat16) and into the query's 16-lane sum. Partial:
// the block holds padded keys (real[v]: the real ones of each 16), which take no part.
template <bool Partial>
inline void flash_softmax(const float* scores, const __mmask16* real, uint16_t* probs, float* maxima, float* sums,
                          float* acc) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  for (int r = 0; r < kFlashRows; ++r) {
    const float* row = scores + r * kFlashKeys;
    __m512 x[kKeyVecs];
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int v = 0; v < kKeyVecs; ++v) {
      x[v] = _mm512_load_ps(row + 16 * v);
      if (Partial) x[v] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), real[v], x[v]);
      bm = _mm512_max_ps(bm, x[v]);
    }
    __m512 sum = _mm512_load_ps(sums + 16 * r);
    if (_mm512_cmp_ps_mask(bm, _mm512_set1_ps(maxima[r]), _CMP_GT_OQ)) {  // a new maximum: rescale what came before
      const float mx = _mm512_reduce_max_ps(bm);
      const __m512 alpha = _mm512_set1_ps(std::exp(maxima[r] - mx));
      float* o = acc + r * kHeadDim;
      for (int d = 0; d < 4; ++d) _mm512_store_ps(o + 16 * d, _mm512_mul_ps(_mm512_load_ps(o + 16 * d), alpha));
      sum = _mm512_mul_ps(sum, alpha);
      maxima[r] = mx;
    }
    const __m512 m = _mm512_set1_ps(maxima[r] * 1.44269504088896341f);
    __m512 e[kKeyVecs];
    for (int v = 0; v < kKeyVecs; ++v) {
      e[v] = exp2_ps(_mm512_fmsub_ps(x[v], log2e, m));
      if (Partial) e[v] = _mm512_maskz_mov_ps(real[v], e[v]);
      sum = _mm512_add_ps(sum, e[v]);
    }
    _mm512_store_ps(sums + 16 * r, sum);
    uint16_t* prow = probs + r * kFlashKeys;
    for (int v = 0; v < kKeyVecs; v += 2)
      _mm512_store_si512(prow + 16 * v, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[v + 1], e[v])));
  }
}

void attention_head_amx(const uint16_t* qkv, int64_t n, int64_t ld, int64_t c, int64_t q_col, uint16_t* out,
                        int64_t out_ld, int64_t out_col, HeadScratch& s) {
  const int64_t nq = (n + kFlashRows - 1) / kFlashRows * kFlashRows;
  const int64_t nk = (n + kFlashKeys - 1) / kFlashKeys * kFlashKeys;
  pack_head(qkv, n, ld, c, q_col, nq, nk, s);
  alignas(64) float scores[kFlashRows * kFlashKeys];
  alignas(64) uint16_t probs[kFlashRows * kFlashKeys];
  alignas(64) float acc[kFlashRows * kHeadDim];
  alignas(64) float sums[kFlashRows * 16];  // per query, 16 lanes of its running sum
  float maxima[kFlashRows];
  constexpr int64_t kScoreStride = kFlashKeys * 4, kProbStride = kFlashKeys * 2, kAccStride = kHeadDim * 4;
  for (int64_t i0 = 0; i0 < nq; i0 += kFlashRows) {
    std::fill(acc, acc + kFlashRows * kHeadDim, 0.0f);
    std::fill(sums, sums + kFlashRows * 16, 0.0f);
    std::fill(maxima, maxima + kFlashRows, -INFINITY);
    const uint32_t* qa = &s.q[i0 * kPairs];
    for (int64_t j0 = 0; j0 < nk; j0 += kFlashKeys) {
      _tile_loadd(4, qa, kPairs * 4);  // q: queries 0-15 dimensions 0-31, 0-15 32-63, 16-31 0-31, 16-31 32-63
      _tile_loadd(5, qa + 16, kPairs * 4);
      _tile_loadd(6, qa + 16 * kPairs, kPairs * 4);
      _tile_loadd(7, qa + 16 * kPairs + 16, kPairs * 4);
      for (int jq = 0; jq < kKeyVecs; ++jq) {  // keys j0 + 16 jq ... + 15: tiles 2-3 k, 0-1 the scores
        const uint32_t* kb = &s.k[(j0 / 16 + jq) * kPairs * 16];
        _tile_loadd(2, kb, 64);
        _tile_loadd(3, kb + 16 * 16, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_dpbf16ps(0, 4, 2);
        _tile_dpbf16ps(1, 6, 2);
        _tile_dpbf16ps(0, 5, 3);
        _tile_dpbf16ps(1, 7, 3);
        _tile_stored(0, scores + 16 * jq, kScoreStride);
        _tile_stored(1, scores + 16 * kFlashKeys + 16 * jq, kScoreStride);
      }
      // real keys of this block per 16-key quarter (the padded ones past n take no part)
      __mmask16 real[kKeyVecs];
      for (int v = 0; v < kKeyVecs; ++v) {
        const int64_t left = std::clamp<int64_t>(n - j0 - 16 * v, 0, 16);
        real[v] = static_cast<__mmask16>((1u << left) - 1u);
      }
      if (j0 + kFlashKeys <= n)
        flash_softmax<false>(scores, real, probs, maxima, sums, acc);
      else
        flash_softmax<true>(scores, real, probs, maxima, sums, acc);
      for (int half = 0; half < 2; ++half) {  // acc += p v, 16 queries at a time
        float* o = acc + half * 16 * kHeadDim;
        _tile_loadd(0, o, kAccStride);
        _tile_loadd(1, o + 16, kAccStride);
        _tile_loadd(2, o + 32, kAccStride);
        _tile_loadd(3, o + 48, kAccStride);
        for (int ks = 0; ks < kFlashKeys / 32; ++ks) {  // 32 keys a step
          _tile_loadd(4, probs + half * 16 * kFlashKeys + 32 * ks, kProbStride);
          const uint32_t* vb = &s.v[(j0 / 2 + 16 * ks) * kHeadDim];
          _tile_loadd(5, vb, kHeadDim * 4);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, vb + 16, kHeadDim * 4);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, vb + 32, kHeadDim * 4);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, vb + 48, kHeadDim * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, o, kAccStride);
        _tile_stored(1, o + 16, kAccStride);
        _tile_stored(2, o + 32, kAccStride);
        _tile_stored(3, o + 48, kAccStride);
      }
    }
    for (int r = 0; r < kFlashRows; ++r) {
      const int64_t i = i0 + r;
      if (i >= n) break;
      store_row(acc + r * kHeadDim, 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(sums + 16 * r)),
                out + i * out_ld + out_col);
    }
  }
}
#endif  // MOGE_AMX_ATTENTION
#endif  // MOGE_BF16_ATTENTION

}  // namespace

extern "C" {

int moge_runner_set_threads(int threads) { return g_runner_pool.set_threads(threads); }

// x: rows x cols (row stride ld elements), float32 (dtype 0) or bfloat16 (1), each column multiplied by
// inv_smooth[col] first unless inv_smooth is null -> out: rows x cols int8 (contiguous), scales: rows.
// Returns 0, or -1 for an unknown dtype.
int moge_quantize_rows(const void* x, int dtype, int64_t rows, int64_t cols, int64_t ld, const float* inv_smooth,
                       int8_t* out, float* scales) {
  if (dtype == kFloat32)
    quantize_rows(static_cast<const float*>(x), inv_smooth, rows, cols, ld, out, scales);
  else if (dtype == kBFloat16)
    quantize_rows(static_cast<const uint16_t*>(x), inv_smooth, rows, cols, ld, out, scales);
  else
    return -1;
  return 0;
}

// acc: rows x cols int32 (contiguous) -> out: rows x cols float32 (out_dtype 0) or bfloat16 (1). Returns 0 or -1.
int moge_dequantize(const int32_t* acc, int64_t rows, int64_t cols, const float* row_scale, const float* col_scale,
                    const float* bias, int out_dtype, void* out) {
  if (out_dtype == kFloat32)
    dequantize<kFloat32>(acc, rows, cols, row_scale, col_scale, bias, out);
  else if (out_dtype == kBFloat16)
    dequantize<kBFloat16>(acc, rows, cols, row_scale, col_scale, bias, out);
  else
    return -1;
  return 0;
}

// 1 when this build has the fused bfloat16 attention (the CPU has AVX512-BF16), else 0.
int moge_attention_supported() {
#ifdef MOGE_BF16_ATTENTION
  return 1;
#else
  return 0;
#endif
}

// 1 when the fused attention can run its products on AMX tiles (an AMX build, and Linux lets this process use
// them), else 0.
int moge_attention_amx_supported() {
#ifdef MOGE_AMX_ATTENTION
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// Multi-head attention of one image: qkv (n, 3 * c) bfloat16 row-major ([q | k | v], heads of 64 columns each,
// q already scaled by 1/sqrt(64)) -> out (n, c) bfloat16 row-major; the products on AMX tiles if amx is non-zero
// (then moge_attention_amx_supported() must be 1), else by AVX512-BF16 dot products. Returns 0; -1 without
// AVX512-BF16 (or without AMX, if asked) in this build; -2 if c is not num_heads * 64.
int moge_attention_bf16(const uint16_t* qkv, int64_t n, int64_t c, int64_t num_heads, int amx, uint16_t* out) {
#ifdef MOGE_BF16_ATTENTION
  if (num_heads <= 0 || c != num_heads * kHeadDim) return -2;
  if (amx) {
#ifdef MOGE_AMX_ATTENTION
    if (!amx_permitted()) return -1;
    runner_pool().parallel_for(num_heads, 1, [=](int64_t h0, int64_t h1) {
      static thread_local HeadScratch scratch;
      configure_tiles();
      for (int64_t h = h0; h < h1; ++h)
        attention_head_amx(qkv, n, 3 * c, c, h * kHeadDim, out, c, h * kHeadDim, scratch);
      _tile_release();
    });
    return 0;
#else
    return -1;
#endif
  }
  runner_pool().parallel_for(num_heads, 1, [=](int64_t h0, int64_t h1) {
    static thread_local HeadScratch scratch;
    for (int64_t h = h0; h < h1; ++h) attention_head(qkv, n, 3 * c, c, h * kHeadDim, out, c, h * kHeadDim, scratch);
  });
  return 0;
#else
  (void)qkv; (void)n; (void)c; (void)num_heads; (void)amx; (void)out;
  return -1;
#endif
}

}  // extern "C"
