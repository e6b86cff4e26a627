// Kernels of the CPU runner (tt_moge/runners/fixed_graph.py), in the same native library as the host code:
//
// * moge_quantize_rows: float32/bfloat16 rows -> int8 with one scale per row (the activations of the int8 ViT
//   matmuls), one pass where torch needs six;
// * moge_dequantize: the int32 accumulators of those matmuls -> acc * row_scale * col_scale + bias in bfloat16 or
//   float32, one pass where torch needs five.
//
// Both follow the torch reference (tt_moge/runners/cpu_kernels.py) operation for operation, so the results are
// bit-identical to it. They run on their own thread pool (moge_runner_set_threads), apart from the host
// kernels' pool. (A native bfloat16 softmax for the attention was tried and dropped: ATen's was faster.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_pool.h"

namespace {

std::mutex g_runner_pool_mutex;
std::unique_ptr<moge::ThreadPool> g_runner_pool;

moge::ThreadPool& runner_pool() {
  std::lock_guard<std::mutex> lock(g_runner_pool_mutex);
  if (!g_runner_pool) g_runner_pool.reset(new moge::ThreadPool(1));
  return *g_runner_pool;
}

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

}  // namespace

extern "C" {

int moge_runner_set_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_runner_pool_mutex);
  if (!g_runner_pool)
    g_runner_pool.reset(new moge::ThreadPool(threads));
  else if (g_runner_pool->threads() != threads)
    g_runner_pool->resize(threads);
  return g_runner_pool->threads();
}

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

}  // extern "C"
