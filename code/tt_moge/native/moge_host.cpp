// tt_moge native host library: the fused finish pass, the focal/shift solve, PNG unfiltering and the
// uint8 -> float canvas.
//
// Built on first use by tt_moge/native/build.py (g++ -O3 -ffp-contract=off), loaded with ctypes.
// The Python/torch code in tt_moge/host/{finish,solve}.py is the reference: every step here follows the same
// order of float operations, so masks are identical and floats agree to a few ulp (tests/test_native.py).
// The functions allocate only small per-call tables; the caller owns every input and output buffer.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "thread_pool.h"

namespace {

constexpr int kAbiVersion = 6;  // bump when an exported signature changes (the Python side checks it)

moge::LazyPool g_pool;  // the host kernels' threads

moge::ThreadPool& pool() { return g_pool.get(); }

// ---------------------------------------------------------------------------------------------- finish
// The float arithmetic of ATen's channels-last kernels on x86-64 with FMA: they are compiled with fused
// multiply-adds, so the source coordinate, the four-tap sum and the norm of F.normalize use fmaf in the same
// places (std::fma is exact everywhere; without FMA hardware it is slower, not wrong). ATen picks other
// kernels for other memory layouts (a channel-planar normal map is normalised without FMA), hence "a few
// ulp" rather than "identical" for the normals.
//
// One axis of torch's bilinear resize (align_corners=False, half-pixel centres):
// src = max(ratio * (dst + 0.5) - 0.5, 0) with ratio = in / out, in float.
struct Tap {
  int64_t i0, i1;
  float l0, l1;
};

std::vector<Tap> bilinear_taps(int64_t in_size, int64_t out_size) {
  std::vector<Tap> taps(out_size);
  if (in_size == out_size) {  // ATen copies this axis exactly
    for (int64_t i = 0; i < out_size; ++i) taps[i] = {i, i, 1.0f, 0.0f};
    return taps;
  }
  const float ratio = static_cast<float>(in_size) / static_cast<float>(out_size);
  for (int64_t i = 0; i < out_size; ++i) {
    float src = std::fma(ratio, static_cast<float>(i) + 0.5f, -0.5f);
    if (src < 0.0f) src = 0.0f;
    int64_t i0 = std::min(static_cast<int64_t>(std::floor(src)), in_size - 1);
    float l1 = std::min(std::max(src - static_cast<float>(i0), 0.0f), 1.0f);
    int64_t i1 = i0 + (i0 < in_size - 1 ? 1 : 0);
    taps[i] = {i0, i1, 1.0f - l1, l1};
  }
  return taps;
}

// A strided (rows, cols, channels) map of float32, or of bfloat16 (bf16: the normal and the mask probability as
// the Tenstorrent runner reads them back); strides in elements, any layout (runners differ).
struct Map {
  const void* data;
  int64_t sy, sx, sc;
  bool bf16;
};

// One element as float: float32 as is, bfloat16 (its bits, uint16_t) widened exactly (the high half of a float32).
inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct FinishArgs {
  Map points, normal, prob;  // normal.data / prob.data may be null
  int64_t x0, y0, content_w, content_h, out_w, out_h;
  float shift, scale, mask_threshold;  // valid: probability > mask_threshold (constants.MASK_THRESHOLD)
  bool has_scale, apply_mask;
  const float* col_factor;  // (out_w,) (u - cx) / fx; null: no force_projection
  const float* row_factor;  // (out_h,) (v - cy) / fy
  float *out_points, *out_depth, *out_normal;
  uint8_t* out_mask;
};

constexpr int kBlock = 64;  // pixels per block: gathered into channel planes, computed in SIMD-friendly loops

// Channel planes of one block of output pixels: 0-2 points (when resizing: x/d, y/d, 1/d), 3-5 normal,
// 6 mask probability.
struct Block {
  alignas(64) float ch[7][kBlock];
};

// The four-tap sum in the order and with the fused multiply-adds of ATen's channels-last bilinear kernel.
inline float taps4(float i00, float i01, float i10, float i11, float w00, float w01, float w10, float w11) {
  return std::fma(i11, w11, std::fma(i10, w10, std::fma(i00, w00, i01 * w01)));
}

// Horizontal taps and 2-D weights of one block of output pixels in one output row.
struct BlockTaps {
  alignas(64) int64_t c0[kBlock], c1[kBlock];  // canvas columns
  alignas(64) float w00[kBlock], w01[kBlock], w10[kBlock], w11[kBlock];

  void set(const Tap* tx, int64_t x0, float h0, float h1, int n) {
    for (int i = 0; i < n; ++i) {
      c0[i] = x0 + tx[i].i0;
      c1[i] = x0 + tx[i].i1;
      w00[i] = h0 * tx[i].l0;
      w01[i] = h0 * tx[i].l1;
      w10[i] = h1 * tx[i].l0;
      w11[i] = h1 * tx[i].l1;
    }
  }
};

// All channels of one pixel at once, so each tap's columns and weights are loaded once per pixel (1.6x
// faster than one channel at a time on the development machine).
// kRays: also resample the ray directions (only read without force_projection; the default skips them).
// NT, MT: the element types of the normal and the mask probability (float, or uint16_t for bfloat16).
template <int64_t kPointsSx, int64_t kNormalSx, bool kRays, typename NT, typename MT>  // strides: 0 = runtime
void gather_resized_impl(const FinishArgs& a, int64_t r0, int64_t r1, const BlockTaps& t, int n, Block& b) {
  const int64_t psx = kPointsSx ? kPointsSx : a.points.sx, nsx = kNormalSx ? kNormalSx : a.normal.sx;
  const int64_t psc = a.points.sc, nsc = a.normal.sc;
  const float* points = static_cast<const float*>(a.points.data);
  const float *p0 = points + r0 * a.points.sy, *p1 = points + r1 * a.points.sy;
  const bool has_normal = a.normal.data != nullptr, has_prob = a.prob.data != nullptr;
  const NT* normal = static_cast<const NT*>(a.normal.data);
  const MT* prob = static_cast<const MT*>(a.prob.data);
  const NT *n0 = has_normal ? normal + r0 * a.normal.sy : nullptr;
  const NT *n1 = has_normal ? normal + r1 * a.normal.sy : nullptr;
  const MT *m0 = has_prob ? prob + r0 * a.prob.sy : nullptr;
  const MT *m1 = has_prob ? prob + r1 * a.prob.sy : nullptr;
  const float shift = a.shift;
  // Perspective-correct resampling: per tap, inverse depth 1 / (z + shift) (0 behind the camera) and the ray
  // directions x / (z + shift), y / (z + shift), which are linear in pixel coordinates across a plane.
  auto ray = [shift, psc](const float* q, float& rx, float& ry, float& inv) {
    const float d = q[2 * psc] + shift;
    inv = d > 0.0f ? 1.0f / d : 0.0f;
    if (kRays) {
      rx = q[0] * inv;
      ry = q[psc] * inv;
    }
  };
  for (int i = 0; i < n; ++i) {
    const int64_t c0 = t.c0[i], c1 = t.c1[i];
    const float w00 = t.w00[i], w01 = t.w01[i], w10 = t.w10[i], w11 = t.w11[i];
    const float *q00 = p0 + c0 * psx, *q01 = p0 + c1 * psx, *q10 = p1 + c0 * psx, *q11 = p1 + c1 * psx;
    float r[3][4];  // [x/d, y/d, 1/d][tap 00, 01, 10, 11]
    ray(q00, r[0][0], r[1][0], r[2][0]);
    ray(q01, r[0][1], r[1][1], r[2][1]);
    ray(q10, r[0][2], r[1][2], r[2][2]);
    ray(q11, r[0][3], r[1][3], r[2][3]);
    for (int c = kRays ? 0 : 2; c < 3; ++c) b.ch[c][i] = taps4(r[c][0], r[c][1], r[c][2], r[c][3], w00, w01, w10, w11);
    if (has_normal) {
      const NT *e00 = n0 + c0 * nsx, *e01 = n0 + c1 * nsx, *e10 = n1 + c0 * nsx, *e11 = n1 + c1 * nsx;
      for (int c = 0; c < 3; ++c)
        b.ch[3 + c][i] = taps4(load(e00 + c * nsc), load(e01 + c * nsc), load(e10 + c * nsc), load(e11 + c * nsc),
                               w00, w01, w10, w11);
    }
    if (has_prob) {
      const int64_t msx = a.prob.sx;
      b.ch[6][i] =
          taps4(load(m0 + c0 * msx), load(m0 + c1 * msx), load(m1 + c0 * msx), load(m1 + c1 * msx), w00, w01, w10, w11);
    }
  }
}

template <bool kRays, typename NT, typename MT>
void gather_resized_layout(const FinishArgs& a, int64_t r0, int64_t r1, const BlockTaps& t, int n, Block& b) {
  // The layouts of the runners: points (H, W, 3) contiguous; normal contiguous, channel-planar or absent.
  const bool normal_3 = a.normal.data == nullptr || a.normal.sx == 3;
  if (a.points.sx == 3 && normal_3)
    gather_resized_impl<3, 3, kRays, NT, MT>(a, r0, r1, t, n, b);
  else if (a.points.sx == 3 && a.normal.sx == 1)
    gather_resized_impl<3, 1, kRays, NT, MT>(a, r0, r1, t, n, b);
  else
    gather_resized_impl<0, 0, kRays, NT, MT>(a, r0, r1, t, n, b);
}

template <bool kRays>
void gather_resized_rays(const FinishArgs& a, int64_t r0, int64_t r1, const BlockTaps& t, int n, Block& b) {
  const bool normal_bf16 = a.normal.data && a.normal.bf16, prob_bf16 = a.prob.data && a.prob.bf16;
  if (normal_bf16 && prob_bf16)
    gather_resized_layout<kRays, uint16_t, uint16_t>(a, r0, r1, t, n, b);
  else if (normal_bf16)
    gather_resized_layout<kRays, uint16_t, float>(a, r0, r1, t, n, b);
  else if (prob_bf16)
    gather_resized_layout<kRays, float, uint16_t>(a, r0, r1, t, n, b);
  else
    gather_resized_layout<kRays, float, float>(a, r0, r1, t, n, b);
}

void gather_resized(const FinishArgs& a, int64_t r0, int64_t r1, const BlockTaps& t, int n, Block& b) {
  if (a.col_factor)  // force_projection: x and y come from the depth, the ray directions are not needed
    gather_resized_rays<false>(a, r0, r1, t, n, b);
  else
    gather_resized_rays<true>(a, r0, r1, t, n, b);
}

template <typename T>
void gather_cropped_as(const Map& m, int first, int channels, int64_t r, int64_t x0, int n, Block& b) {
  const T* row = static_cast<const T*>(m.data) + r * m.sy + x0 * m.sx;
  for (int c = 0; c < channels; ++c) {
    const T* p = row + c * m.sc;
    float* dst = b.ch[first + c];
    if (m.sx == 1) {
      for (int i = 0; i < n; ++i) dst[i] = load(p + i);
    } else {
      for (int i = 0; i < n; ++i) dst[i] = load(p + i * m.sx);
    }
  }
}

void gather_cropped(const Map& m, int first, int channels, int64_t r, int64_t x0, int n, Block& b) {
  if (m.bf16)
    gather_cropped_as<uint16_t>(m, first, channels, r, x0, n, b);
  else
    gather_cropped_as<float>(m, first, channels, r, x0, n, b);
}

// The normals of a block (channels 3-5) to unit length, as F.normalize: v / max(|v|, 1e-12).
void normalize(Block& b, int n) {
  float *nx = b.ch[3], *ny = b.ch[4], *nz = b.ch[5];
  for (int i = 0; i < n; ++i) {
    const float norm = std::max(std::sqrt(std::fma(nz[i], nz[i], std::fma(ny[i], ny[i], nx[i] * nx[i]))), 1e-12f);
    nx[i] = nx[i] / norm;
    ny[i] = ny[i] / norm;
    nz[i] = nz[i] / norm;
  }
}

// bfloat16 normals (channels 3-5, up to 2^-8 off unit length) to unit length: one reciprocal and three products a
// pixel (half the divisions of `normalize`; within a few ulp of it).
void renormalize(Block& b, int n) {
  float *nx = b.ch[3], *ny = b.ch[4], *nz = b.ch[5];
  for (int i = 0; i < n; ++i) {
    const float inv =
        1.0f / std::max(std::sqrt(std::fma(nz[i], nz[i], std::fma(ny[i], ny[i], nx[i] * nx[i]))), 1e-12f);
    nx[i] = nx[i] * inv;
    ny[i] = ny[i] * inv;
    nz[i] = nz[i] * inv;
  }
}

void finish_rows(const FinishArgs& a, const std::vector<Tap>& tx, const std::vector<Tap>& ty, int64_t row_begin,
                 int64_t row_end) {
  const bool resize = !tx.empty(), has_normal = a.normal.data != nullptr, has_prob = a.prob.data != nullptr;
  const float inf = std::numeric_limits<float>::infinity();
  Block b;
  BlockTaps taps;
  alignas(64) float depth[kBlock], px[kBlock], py[kBlock];
  alignas(64) uint8_t valid[kBlock];
  for (int64_t y = row_begin; y < row_end; ++y) {
    const Tap vy = resize ? ty[y] : Tap{y, y, 1.0f, 0.0f};
    const int64_t r0 = a.y0 + vy.i0, r1 = a.y0 + vy.i1;
    for (int64_t xb = 0; xb < a.out_w; xb += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, a.out_w - xb));
      if (resize) {
        taps.set(tx.data() + xb, a.x0, vy.l0, vy.l1, n);
        gather_resized(a, r0, r1, taps, n, b);
        if (has_normal) normalize(b, n);
      } else {
        gather_cropped(a.points, 0, 3, r0, a.x0 + xb, n, b);
        if (has_normal) gather_cropped(a.normal, 3, 3, r0, a.x0 + xb, n, b);
        if (has_normal && a.normal.bf16) renormalize(b, n);  // bfloat16 normals: unit length again
        if (has_prob) gather_cropped(a.prob, 6, 1, r0, a.x0 + xb, n, b);
      }
      const float* prob = b.ch[6];
      if (resize) {  // channel 2 holds the resampled inverse depth, channels 0-1 the ray directions
        for (int i = 0; i < n; ++i) depth[i] = b.ch[2][i] > 0.0f ? 1.0f / b.ch[2][i] : -1.0f;
        if (!a.col_factor) {
          for (int i = 0; i < n; ++i) {
            b.ch[0][i] = b.ch[0][i] * depth[i];
            b.ch[1][i] = b.ch[1][i] * depth[i];
          }
        }
      } else {
        for (int i = 0; i < n; ++i) depth[i] = b.ch[2][i] + a.shift;
      }
      for (int i = 0; i < n; ++i) valid[i] = (has_prob ? prob[i] > a.mask_threshold : true) & (depth[i] > 0.0f);
      if (a.col_factor) {
        const float* col = a.col_factor + xb;
        const float row = a.row_factor[y];
        for (int i = 0; i < n; ++i) {
          px[i] = depth[i] * col[i];
          py[i] = depth[i] * row;
        }
      } else {
        for (int i = 0; i < n; ++i) {
          px[i] = b.ch[0][i];
          py[i] = b.ch[1][i];
        }
      }
      if (a.has_scale) {
        for (int i = 0; i < n; ++i) {
          px[i] = px[i] * a.scale;
          py[i] = py[i] * a.scale;
          depth[i] = depth[i] * a.scale;
        }
      }
      if (a.apply_mask) {
        for (int i = 0; i < n; ++i) {
          const bool keep = valid[i];
          px[i] = keep ? px[i] : inf;
          py[i] = keep ? py[i] : inf;
          depth[i] = keep ? depth[i] : inf;
          for (int c = 3; c < 6; ++c) b.ch[c][i] = keep ? b.ch[c][i] : 0.0f;
        }
      }
      const int64_t o = y * a.out_w + xb;
      float* op = a.out_points + 3 * o;
      for (int i = 0; i < n; ++i) {
        op[3 * i] = px[i];
        op[3 * i + 1] = py[i];
        op[3 * i + 2] = depth[i];
      }
      std::memcpy(a.out_depth + o, depth, n * sizeof(float));
      std::memcpy(a.out_mask + o, valid, n);
      if (a.out_normal) {
        float* on = a.out_normal + 3 * o;
        for (int i = 0; i < n; ++i) {
          on[3 * i] = b.ch[3][i];
          on[3 * i + 1] = b.ch[4][i];
          on[3 * i + 2] = b.ch[5][i];
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- solve
// The shift minimising sum_i |focal * xy_i / (z_i + shift) - uv_i|^2 (focal fixed, or eliminated in closed
// form), exactly the algorithm of tt_moge/host/solve.py: safeguarded Newton from shift 0, then the pole-free
// intervals just beyond the nearest poles are sampled and refined where they beat it.
struct Problem {
  std::vector<double> a, b, z;  // a_i = xy_i . uv_i, b_i = |xy_i|^2
  double c = 0.0;               // sum |uv_i|^2
  bool has_focal = false;
  double focal = 0.0;

  Problem(const double* uv, const double* xyz, int64_t n, double focal_in) : a(n), b(n), z(n) {
    has_focal = !std::isnan(focal_in);
    focal = focal_in;
    for (int64_t i = 0; i < n; ++i) {
      const double x = xyz[3 * i], y = xyz[3 * i + 1], u = uv[2 * i], v = uv[2 * i + 1];
      a[i] = x * u + y * v;
      b[i] = x * x + y * y;
      z[i] = xyz[3 * i + 2];
      c += u * u + v * v;
    }
  }

  double cost(double shift) const {
    double sa = 0.0, sb = 0.0;
    for (size_t i = 0; i < z.size(); ++i) {
      const double inv = 1.0 / (z[i] + shift);
      sa += a[i] * inv;
      sb += b[i] * inv * inv;
    }
    const double value = has_focal ? focal * focal * sb - 2 * focal * sa + c : c - sa * sa / sb;
    return std::isfinite(value) ? value : std::numeric_limits<double>::infinity();
  }

  void derivatives(double shift, double& cost, double& grad, double& curv) const {
    double sa = 0, sb = 0, da = 0, db = 0, dda = 0, ddb = 0;
    for (size_t i = 0; i < z.size(); ++i) {
      const double inv = 1.0 / (z[i] + shift), inv2 = inv * inv;
      const double ai = a[i] * inv, bi2 = b[i] * inv2;
      sa += ai;
      sb += bi2;
      da += ai * inv;
      db += bi2 * inv;
      dda += ai * inv2;
      ddb += bi2 * inv2;
    }
    da = -da;
    db = -2.0 * db;
    dda = 2.0 * dda;
    ddb = 6.0 * ddb;
    if (has_focal) {
      const double f = focal;
      cost = f * f * sb - 2 * f * sa + c;
      grad = f * f * db - 2 * f * da;
      curv = f * f * ddb - 2 * f * dda;
      return;
    }
    if (!(sb > 0)) {
      cost = std::numeric_limits<double>::infinity();
      grad = curv = 0.0;
      return;
    }
    // g(s) = C - A^2 / B with the best focal A / B eliminated
    const double h = sa * sa / sb;
    const double dh = 2 * sa * da / sb - sa * sa * db / (sb * sb);
    const double ddh = 2 * (da * da + sa * dda) / sb - 4 * sa * da * db / (sb * sb) - sa * sa * ddb / (sb * sb) +
                       2 * sa * sa * db * db / (sb * sb * sb);
    cost = c - h;
    grad = -dh;
    curv = -ddh;
  }
};

constexpr double kCostRoundOff = 1e-12;  // relative to sum |uv|^2 (solve.py's _COST_ROUND_OFF)

void newton(const Problem& p, double shift, double scale, double& out_shift, double& out_cost) {
  const double noise = kCostRoundOff * p.c;
  double cost, grad, curv;
  p.derivatives(shift, cost, grad, curv);
  if (!std::isfinite(cost)) {
    out_shift = shift;
    out_cost = std::numeric_limits<double>::infinity();
    return;
  }
  for (int iter = 0; iter < 100; ++iter) {
    double step = curv > 0 ? -grad / curv : -std::copysign(0.1 * scale, grad);
    double trial = shift, t_cost = 0, t_grad = 0, t_curv = 0;
    bool accepted = false;
    // Backtrack until the cost does not increase (a pole where z + shift = 0 has infinite cost), or, near
    // the minimum, increases by round-off only while the gradient shrinks (solve.py's _newton says why).
    for (int k = 0; k < 60; ++k) {
      trial = shift + step;
      p.derivatives(trial, t_cost, t_grad, t_curv);
      if (std::isfinite(t_cost) &&
          (t_cost <= cost || (t_cost <= cost + noise && std::fabs(t_grad) < std::fabs(grad)))) {
        accepted = true;
        break;
      }
      step *= 0.5;
    }
    if (!accepted) break;
    const bool converged = std::fabs(trial - shift) <= 1e-12 * (scale + std::fabs(trial));
    shift = trial;
    cost = t_cost;
    grad = t_grad;
    curv = t_curv;
    if (converged || grad == 0.0) break;
  }
  out_shift = shift;
  out_cost = cost;
}

constexpr int kBeyondPoles = 16;  // pole-free intervals past the nearest poles that are searched
constexpr int kIntervalSamples = 9;

double minimise_shift(const Problem& p) {
  const int64_t n = static_cast<int64_t>(p.z.size());
  double mean_abs = 0.0;
  for (double z : p.z) mean_abs += std::fabs(z);
  const double scale = std::max(1e-12, mean_abs / static_cast<double>(n));
  double best, best_cost;
  newton(p, 0.0, scale, best, best_cost);
  // The kBeyondPoles + 1 smallest distinct z (poles at shift = -z), ascending.
  std::vector<double> zs(p.z);
  std::sort(zs.begin(), zs.end());
  zs.erase(std::unique(zs.begin(), zs.end()), zs.end());
  if (zs.size() > kBeyondPoles + 1) zs.resize(kBeyondPoles + 1);
  if (zs.size() < 2) return best;
  // numpy.linspace(0.05, 0.95, 9)
  double fractions[kIntervalSamples];
  for (int s = 0; s < kIntervalSamples; ++s) fractions[s] = s * ((0.95 - 0.05) / (kIntervalSamples - 1)) + 0.05;
  fractions[kIntervalSamples - 1] = 0.95;
  const double threshold = best_cost;  // intervals are chosen against the cost of the first basin
  for (size_t k = 0; k + 1 < zs.size(); ++k) {
    double k_best = std::numeric_limits<double>::infinity(), k_shift = 0.0;
    for (int s = 0; s < kIntervalSamples; ++s) {
      const double shift = -(zs[k] + fractions[s] * (zs[k + 1] - zs[k]));
      const double cost = p.cost(shift);
      if (cost < k_best) {
        k_best = cost;
        k_shift = shift;
      }
    }
    if (!(k_best < threshold)) continue;
    double shift, cost;
    newton(p, k_shift, scale, shift, cost);
    if (cost < best_cost) {
      best = shift;
      best_cost = cost;
    }
  }
  return best;
}

// (focal, shift) for samples; focal_in NaN = solve it too. Fewer than 2 samples: (1, 0) or (focal_in, 0).
void solve(const double* uv, const double* xyz, int64_t n, double focal_in, double* focal_out, double* shift_out) {
  const bool has_focal = !std::isnan(focal_in);
  if (n < 2) {
    *focal_out = has_focal ? focal_in : 1.0;
    *shift_out = 0.0;
    return;
  }
  Problem p(uv, xyz, n, focal_in);
  const double shift = minimise_shift(p);
  *shift_out = shift;
  if (has_focal) {
    *focal_out = focal_in;
    return;
  }
  double num = 0.0, den = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double inv = 1.0 / (xyz[3 * i + 2] + shift);
    const double px = xyz[3 * i] * inv, py = xyz[3 * i + 1] * inv;
    num += px * uv[2 * i] + py * uv[2 * i + 1];
    den += px * px + py * py;
  }
  *focal_out = den > 0 ? num / den : 1.0;
}

// ---------------------------------------------------------------------------------------------- canvas
// The uint8 RGB content placed on a gray canvas, as float32 in [0, 1]: value / 255 by IEEE division, the
// same bits as torch's div_(255.0) (true division; vectorised, no reciprocal: we build without -ffast-math).
void canvas_rows(const uint8_t* content, int64_t row_stride, int64_t pixel_stride, int64_t w, int64_t h, int64_t x0,
                 int64_t y0, int64_t canvas_w, float pad, float* out, int64_t row_begin, int64_t row_end) {
  for (int64_t y = row_begin; y < row_end; ++y) {
    float* o = out + y * canvas_w * 3;
    const bool inside = y >= y0 && y < y0 + h;
    const int64_t left = inside ? x0 : canvas_w, right = inside ? x0 + w : canvas_w;
    for (int64_t i = 0; i < 3 * left; ++i) o[i] = pad;
    if (inside) {
      const uint8_t* src = content + (y - y0) * row_stride;
      float* dst = o + 3 * x0;
      if (pixel_stride == 3) {
        for (int64_t i = 0; i < 3 * w; ++i) dst[i] = static_cast<float>(src[i]) / 255.0f;
      } else {
        for (int64_t x = 0; x < w; ++x)
          for (int c = 0; c < 3; ++c) dst[3 * x + c] = static_cast<float>(src[x * pixel_stride + c]) / 255.0f;
      }
    }
    for (int64_t i = 3 * right; i < 3 * canvas_w; ++i) o[i] = pad;
  }
}

// The uint8 RGB content placed on a gray canvas as three uint8 planes (3, canvas_h, canvas_w): the canvas a
// runner that takes 8-bit input uploads (the Tenstorrent runner; its device does the / 255).
void canvas_planes_rows(const uint8_t* content, int64_t row_stride, int64_t pixel_stride, int64_t w, int64_t h,
                        int64_t x0, int64_t y0, int64_t canvas_w, int64_t canvas_h, uint8_t pad, uint8_t* out,
                        int64_t row_begin, int64_t row_end) {
  const int64_t plane = canvas_w * canvas_h;
  for (int64_t y = row_begin; y < row_end; ++y) {
    uint8_t* __restrict r = out + y * canvas_w;
    uint8_t* __restrict g = r + plane;
    uint8_t* __restrict b = g + plane;
    const bool inside = y >= y0 && y < y0 + h;
    const int64_t left = inside ? x0 : canvas_w, right = inside ? x0 + w : canvas_w;
    for (uint8_t* p : {r, g, b}) {
      std::memset(p, pad, left);
      std::memset(p + right, pad, canvas_w - right);
    }
    if (!inside) continue;
    const uint8_t* __restrict src = content + (y - y0) * row_stride;
    if (pixel_stride == 3) {  // the stride-3 de-interleave, vectorised by the compiler
      for (int64_t x = 0; x < w; ++x) {
        r[x0 + x] = src[3 * x];
        g[x0 + x] = src[3 * x + 1];
        b[x0 + x] = src[3 * x + 2];
      }
    } else {
      for (int64_t x = 0; x < w; ++x) {
        r[x0 + x] = src[x * pixel_stride];
        g[x0 + x] = src[x * pixel_stride + 1];
        b[x0 + x] = src[x * pixel_stride + 2];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- PNG
inline uint8_t paeth(int a, int b, int c) {
  const int pa = std::abs(b - c), pb = std::abs(a - c), pc = std::abs(a + b - 2 * c);
  return static_cast<uint8_t>((pa <= pb && pa <= pc) ? a : (pb <= pc ? b : c));
}

// Undo one row's PNG filter in place. cur, prev: `stride` bytes (prev all zero for the first row).
bool unfilter_row(int filter, uint8_t* cur, const uint8_t* prev, int64_t stride, int bpp) {
  switch (filter) {
    case 0:
      return true;
    case 1:
      for (int64_t i = bpp; i < stride; ++i) cur[i] = static_cast<uint8_t>(cur[i] + cur[i - bpp]);
      return true;
    case 2:
      for (int64_t i = 0; i < stride; ++i) cur[i] = static_cast<uint8_t>(cur[i] + prev[i]);
      return true;
    case 3:
      for (int64_t i = 0; i < bpp; ++i) cur[i] = static_cast<uint8_t>(cur[i] + (prev[i] >> 1));
      for (int64_t i = bpp; i < stride; ++i) cur[i] = static_cast<uint8_t>(cur[i] + ((cur[i - bpp] + prev[i]) >> 1));
      return true;
    case 4:
      for (int64_t i = 0; i < bpp; ++i) cur[i] = static_cast<uint8_t>(cur[i] + prev[i]);  // paeth(0, b, 0) = b
      for (int64_t i = bpp; i < stride; ++i)
        cur[i] = static_cast<uint8_t>(cur[i] + paeth(cur[i - bpp], prev[i], prev[i - bpp]));
      return true;
    default:
      return false;
  }
}

}  // namespace

extern "C" {

int moge_abi_version() { return kAbiVersion; }

int moge_set_threads(int threads) { return g_pool.set_threads(threads); }

int moge_threads() { return pool().threads(); }

// The fused finish pass (tt_moge/host/finish.py steps 1-8 minus 5, the intrinsics): reads the content box of the
// canvas maps once, writes every output once. Strides are in float elements. Returns 0.
// normal_bf16 / prob_bf16: those maps are bfloat16 (their bits, 2 bytes an element), else float32.
int moge_finish(const float* points, int64_t p_sy, int64_t p_sx, int64_t p_sc, const void* normal, int64_t n_sy,
                int64_t n_sx, int64_t n_sc, int normal_bf16, const void* prob, int64_t m_sy, int64_t m_sx,
                int prob_bf16, int64_t x0, int64_t y0,
                int64_t content_w, int64_t content_h, int64_t out_w, int64_t out_h, float shift, float scale,
                float mask_threshold, int has_scale, const float* col_factor, const float* row_factor, int apply_mask, float* out_points,
                float* out_depth, float* out_normal, uint8_t* out_mask) {
  FinishArgs a{{points, p_sy, p_sx, p_sc, false}, {normal, n_sy, n_sx, n_sc, normal_bf16 != 0},
               {prob, m_sy, m_sx, 0, prob_bf16 != 0}, x0, y0, content_w,
               content_h, out_w, out_h, shift, scale, mask_threshold, has_scale != 0, apply_mask != 0, col_factor, row_factor,
               out_points, out_depth, normal ? out_normal : nullptr, out_mask};
  std::vector<Tap> tx, ty;
  if (content_w != out_w || content_h != out_h) {
    tx = bilinear_taps(content_w, out_w);
    ty = bilinear_taps(content_h, out_h);
  }
  // Rows are independent. Chunks of at least 128k pixels: waking a worker costs more than a smaller chunk
  // saves, and on a loaded machine a late-scheduled worker would delay the whole pass.
  pool().parallel_for(out_h, std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, out_w)),
                      [&](int64_t begin, int64_t end) { finish_rows(a, tx, ty, begin, end); });
  return 0;
}

// (canvas_h, canvas_w, 3) float32 canvas: `content` (h, w, 3) uint8 (byte strides) at (x0, y0), `pad` gray
// around it, every value / 255. Returns 0.
int moge_canvas_to_unit(const uint8_t* content, int64_t row_stride, int64_t pixel_stride, int64_t w, int64_t h,
                        int64_t x0, int64_t y0, int64_t canvas_w, int64_t canvas_h, int pad_gray, float* out) {
  const float pad = static_cast<float>(pad_gray & 255) / 255.0f;
  // One thread: the pass is memory-bound (1.2 ms for 1920x1080 on the development machine) and a second
  // thread did not make it faster.
  canvas_rows(content, row_stride, pixel_stride, w, h, x0, y0, canvas_w, pad, out, 0, canvas_h);
  return 0;
}

int moge_canvas_planes_u8(const uint8_t* content, int64_t row_stride, int64_t pixel_stride, int64_t w, int64_t h,
                          int64_t x0, int64_t y0, int64_t canvas_w, int64_t canvas_h, int pad_gray, uint8_t* out) {
  canvas_planes_rows(content, row_stride, pixel_stride, w, h, x0, y0, canvas_w, canvas_h,
                     static_cast<uint8_t>(pad_gray & 255), out, 0, canvas_h);
  return 0;
}

// Focal/shift of samples uv (n, 2), xyz (n, 3) float64; focal_in NaN = solve the focal too.
int moge_solve(const double* uv, const double* xyz, int64_t n, double focal_in, double* focal_out,
               double* shift_out) {
  solve(uv, xyz, n, focal_in, focal_out, shift_out);
  return 0;
}

// Sample the canvas point map on a (grid_h, grid_w) nearest-neighbour grid (source index i * size / grid, as
// torch's nearest), keep samples inside the content box whose mask is set (mask_u8 != 0, or prob > 0.5, or
// all when both are null), then solve. u (canvas_w,), v (canvas_h,): the view-plane axes (float32).
// Returns the number of samples used.
// prob_bf16: `prob` is bfloat16 (its bits), else float32.
int64_t moge_recover_camera(const float* points, int64_t p_sy, int64_t p_sx, int64_t p_sc, const uint8_t* mask_u8,
                            const void* prob, int prob_bf16, int64_t m_sy, int64_t m_sx, int64_t canvas_w, int64_t canvas_h,
                            int64_t x0, int64_t y0, int64_t x1, int64_t y1, const float* u, const float* v,
                            int64_t grid_h, int64_t grid_w, float mask_threshold, double focal_in, double* focal_out,
                            double* shift_out) {
  std::vector<double> uv, xyz;
  uv.reserve(2 * grid_h * grid_w);
  xyz.reserve(3 * grid_h * grid_w);
  for (int64_t i = 0; i < grid_h; ++i) {
    const int64_t r = i * canvas_h / grid_h;
    if (r < y0 || r >= y1) continue;
    for (int64_t j = 0; j < grid_w; ++j) {
      const int64_t c = j * canvas_w / grid_w;
      if (c < x0 || c >= x1) continue;
      if (mask_u8 && !mask_u8[r * m_sy + c * m_sx]) continue;
      if (prob) {
        const int64_t at = r * m_sy + c * m_sx;
        const float p = prob_bf16 ? load(static_cast<const uint16_t*>(prob) + at) : load(static_cast<const float*>(prob) + at);
        if (!(p > mask_threshold)) continue;
      }
      const float* q = points + r * p_sy + c * p_sx;
      uv.push_back(u[c]);
      uv.push_back(v[r]);
      xyz.push_back(q[0]);
      xyz.push_back(q[p_sc]);
      xyz.push_back(q[2 * p_sc]);
    }
  }
  const int64_t n = static_cast<int64_t>(uv.size() / 2);
  solve(uv.data(), xyz.data(), n, focal_in, focal_out, shift_out);
  return n;
}

// Unfilter a non-interlaced 8-bit PNG image (the inflated IDAT stream: per row a filter byte + width *
// channels bytes) and write it as (height, width, 3) RGB: gray is replicated, alpha dropped (Pillow's
// convert("RGB")). Returns 0, -1 if `size` is too short, -2 on an unknown filter type (row in *bad_row).
int moge_png_unfilter(const uint8_t* data, int64_t size, int64_t width, int64_t height, int channels, uint8_t* out,
                      int64_t* bad_row) {
  const int64_t stride = width * channels;
  if (size < height * (stride + 1)) return -1;
  if (channels == 3) {  // unfilter straight into the output rows
    std::vector<uint8_t> zero(stride, 0);
    for (int64_t y = 0; y < height; ++y) {
      uint8_t* cur = out + y * stride;
      const uint8_t* src = data + y * (stride + 1);
      std::memcpy(cur, src + 1, stride);
      if (!unfilter_row(src[0], cur, y ? cur - stride : zero.data(), stride, 3)) {
        *bad_row = y;
        return -2;
      }
    }
    return 0;
  }
  std::vector<uint8_t> rows(2 * stride, 0);
  uint8_t *prev = rows.data(), *cur = rows.data() + stride;
  for (int64_t y = 0; y < height; ++y) {
    const uint8_t* src = data + y * (stride + 1);
    std::memcpy(cur, src + 1, stride);
    if (!unfilter_row(src[0], cur, prev, stride, channels)) {
      *bad_row = y;
      return -2;
    }
    uint8_t* o = out + y * width * 3;
    if (channels >= 3) {  // RGBA
      for (int64_t x = 0; x < width; ++x) {
        o[3 * x] = cur[4 * x];
        o[3 * x + 1] = cur[4 * x + 1];
        o[3 * x + 2] = cur[4 * x + 2];
      }
    } else {  // gray (1) or gray + alpha (2)
      for (int64_t x = 0; x < width; ++x) o[3 * x] = o[3 * x + 1] = o[3 * x + 2] = cur[x * channels];
    }
    std::swap(prev, cur);
  }
  return 0;
}

}  // extern "C"
