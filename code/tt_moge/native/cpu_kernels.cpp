// Kernels of the CPU runner (tt_moge/runners/fixed_graph.py), in the same native library as the host code:
//
// * moge_quantize_rows: float32/bfloat16 rows -> int8 with one scale per row (the activations of the int8 ViT
//   matmuls, optionally smoothed per column), one pass where torch needs six;
// * moge_dequantize: the int32 accumulators of those matmuls -> acc * row_scale * col_scale + bias in bfloat16 or
//   float32, one pass where torch needs five;
// * moge_attention_bf16: fused multi-head softmax attention in bfloat16 (AVX512-BF16 builds only).
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

// One head. qkv: (n, ld) bfloat16 rows [q | k | v], this head's q at column q_col (k at q_col + c, v at
// q_col + 2c); out: (n, out_ld) bfloat16, this head's 64 columns at out_col.
void attention_head(const uint16_t* qkv, int64_t n, int64_t ld, int64_t c, int64_t q_col, uint16_t* out,
                    int64_t out_ld, int64_t out_col, HeadScratch& s) {
  const int64_t nq = (n + kRowBlock - 1) / kRowBlock * kRowBlock;
  const int64_t nk = (n + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  s.q.assign(nq * kPairs, 0);
  s.k.assign(nk * kPairs, 0);
  s.v.assign(nk / 2 * kHeadDim, 0);
  s.scores.resize(kRowBlock * nk);
  s.probs.resize(kRowBlock * nk);
  // q: per query its 32 pairs; k: per block of 16 keys, per pair, the 16 keys' pairs; v: per pair of keys,
  // per dimension, the two keys' values.
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t* qi = reinterpret_cast<const uint32_t*>(qkv + i * ld + q_col);
    const uint32_t* ki = reinterpret_cast<const uint32_t*>(qkv + i * ld + q_col + c);
    std::memcpy(&s.q[i * kPairs], qi, kPairs * 4);
    uint32_t* kb = &s.k[(i / 16) * kPairs * 16 + (i % 16)];
    for (int p = 0; p < kPairs; ++p) kb[p * 16] = ki[p];
    const uint16_t* vi = qkv + i * ld + q_col + 2 * c;
    uint32_t* vb = &s.v[(i / 2) * kHeadDim];
    const int shift = (i % 2) * 16;
    for (int d = 0; d < kHeadDim; ++d) vb[d] |= static_cast<uint32_t>(vi[d]) << shift;
  }
  float* scores = s.scores.data();
  uint16_t* probs = s.probs.data();
  const int64_t full = n / 16, rem = n % 16;  // 16-key chunks with only real keys; real keys in the next one
  const __mmask16 tail = static_cast<__mmask16>((1u << rem) - 1u);
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
    // softmax numerators (bfloat16) and 1 / sums per row, over the n real keys
    float inv_sum[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      const float* row = scores + r * nk;
      uint16_t* prow = probs + r * nk;
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
      inv_sum[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
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
        const __m512 scale = _mm512_set1_ps(inv_sum[g + r]);
        uint16_t* o = out + i * out_ld + out_col;
        for (int d = 0; d < 4; ++d)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * d),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][d], scale))));
      }
    }
  }
}
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

// Multi-head attention of one image: qkv (n, 3 * c) bfloat16 row-major ([q | k | v], heads of 64 columns each,
// q already scaled by 1/sqrt(64)) -> out (n, c) bfloat16 row-major. Returns 0; -1 without AVX512-BF16 in this
// build; -2 if c is not num_heads * 64.
int moge_attention_bf16(const uint16_t* qkv, int64_t n, int64_t c, int64_t num_heads, uint16_t* out) {
#ifdef MOGE_BF16_ATTENTION
  if (num_heads <= 0 || c != num_heads * kHeadDim) return -2;
  runner_pool().parallel_for(num_heads, 1, [=](int64_t h0, int64_t h1) {
    static thread_local HeadScratch scratch;
    for (int64_t h = h0; h < h1; ++h) attention_head(qkv, n, 3 * c, c, h * kHeadDim, out, c, h * kHeadDim, scratch);
  });
  return 0;
#else
  (void)qkv; (void)n; (void)c; (void)num_heads; (void)out;
  return -1;
#endif
}

}  // extern "C"
