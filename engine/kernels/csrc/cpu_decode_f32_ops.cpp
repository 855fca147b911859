// The fp32 decode loop's elementwise steps (cpu_decode_layers.cpp) in plain loops, each rounding
// exactly as the torch ops the Python layers run: the same bits without one ATen call per op.
//
// Why: in fp32 the loop calls the Python layers' torch ops between the projections so that its
// output stays transformers'; each call is a dispatch, an allocation and a TensorIterator set-up
// of a few microseconds over a few hundred values, and an fp32 decode step of the default model
// made ~25 of them a layer. Each function here replaces several of them by one pass, where every
// value is one IEEE operation per torch op (a multiply, an add, a division, a square root, each
// rounded to fp32 on its own), which no vectorization or operation order can change; the file is
// compiled without implicit contraction, so no multiply-add is fused. What torch computes in a
// way of its own (the sum of squares, a reduction; rsqrt) is still torch's.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "decode_layers.h"

#pragma GCC optimize("fp-contract=off")

namespace asyncllm {

namespace {

// Rows per parallel task: about 16K values, so a decode step's few rows stay on one thread (each
// row's values do not depend on the split).
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

}  // namespace

// engine/layers/norm.py rms_norm on fp32 rows [T, N] (contiguous): w * (x * rsqrt(mean(x^2) + eps)).
// torch's own sum of squares and rsqrt (ATen's rsqrt is not 1 / sqrt for every value), the rest
// here: torch's mean is that sum divided by N, then the add and both products, one rounding each.
torch::Tensor f32_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), "f32_rms_norm: x fp32 [T, N]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1), "f32_rms_norm: w [N]");
  const int64_t t = x.size(0), n = x.size(1);
  torch::Tensor inv = x.pow(2).sum({-1}).contiguous();
  float* ip = inv.data_ptr<float>();
  const float count = static_cast<float>(n), e = static_cast<float>(eps);
  for (int64_t r = 0; r < t; ++r) {
    const float variance = ip[r] / count;
    ip[r] = variance + e;
  }
  inv.rsqrt_();
  torch::Tensor out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float h = xr[i] * ip[r];
        orow[i] = wp[i] * h;
      }
    }
  });
  return out;
}

// engine/layers/rotary.py apply_rotary: x*cos + (x2, x1)*signed_sin, each product and the sum
// rounded on its own, for [T, NH, D] heads (any strides; rows of D contiguous) and [T, D] tables;
// a new contiguous [T, NH, D].
torch::Tensor f32_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 3 && x.stride(2) == 1, "f32_rotary: x fp32 [T, NH, D]");
  const int64_t t = x.size(0), nh = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat &&
                  sin.scalar_type() == torch::kFloat && cos.numel() == t * d && sin.numel() == t * d,
              "f32_rotary: cos/sin fp32 [T, D]");
  torch::Tensor out = torch::empty({t, nh, d}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = x.stride(1);
  at::parallel_for(0, t, grain_rows(nh * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + r * d, *s = sp + r * d;
      for (int64_t h = 0; h < nh; ++h) {
        const float* xr = xp + r * row_stride + h * head_stride;
        float* orow = op + (r * nh + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = xr[i] * c[i], b = xr[i + half] * s[i];
          orow[i] = a + b;
        }
        for (int64_t i = half; i < d; ++i) {
          const float a = xr[i] * c[i], b = xr[i - half] * s[i];
          orow[i] = a + b;
        }
      }
    }
  });
  return out;
}

// KVCache.set_kv (`buffer[loc] = rows`): rows [T, KVH, D] (rows of KVH*D values at any row stride,
// each head's D contiguous) copied to buffer[loc[t]] of a [S, KVH, D] pool.
void store_rows(const torch::Tensor& buffer, const torch::Tensor& loc, const torch::Tensor& rows) {
  const int64_t t = rows.size(0), kvh = rows.size(1), d = rows.size(2), s = buffer.size(0);
  TORCH_CHECK(buffer.is_contiguous() && rows.stride(2) == 1 && loc.scalar_type() == torch::kLong &&
                  loc.is_contiguous() && loc.numel() == t && buffer.scalar_type() == rows.scalar_type(),
              "store_rows: buffer [S, KVH, D], rows [T, KVH, D], loc int64 [T]");
  const int64_t* lp = loc.data_ptr<int64_t>();
  const size_t bytes = static_cast<size_t>(d) * rows.element_size();
  auto* base = static_cast<char*>(buffer.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(lp[r] >= 0 && lp[r] < s, "store_rows: slot out of range");
    for (int64_t h = 0; h < kvh; ++h)
      std::memcpy(base + ((lp[r] * kvh + h) * d) * rows.element_size(),
                  src + (r * rows.stride(0) + h * rows.stride(1)) * rows.element_size(), bytes);
  }
}

}  // namespace asyncllm
