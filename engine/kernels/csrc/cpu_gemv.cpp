// fp32 y = x @ W.T (+ b) for a few rows of x on CPUs: the projections of an fp32 decode step.
//
// Why: a decode step of a small batch reads every weight once, so it is bound by memory
// bandwidth. torch's F.linear hands 1-8 fp32 rows to MKL, which read the weights at ~11 GB/s
// on one thread and did not use a second (2-core AMD Zen 3, AVX2: a plain sum streams 20 GB/s on
// one thread, 30 GB/s on two). Here each thread streams its own band of W's rows, every row read
// once for all rows of x (at most kMaxRows, which stay in L1; four at a time).
//
// Sums: each output is the same fixed-order sum whatever the thread count or the other rows of x:
// two accumulator vectors of the machine's width over k (the even and odd vectors of the row),
// added, their lanes summed in order, then the scalar tail, then the bias. The file is compiled
// like the rest, but every multiply-add is written out (native::fmadd), so no copy of the loop can
// round differently.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_native.h"

using namespace asyncllm;
using native::vf;

namespace {

constexpr int kMaxRows = 8;
constexpr int kGroup = 4;  // rows of x per pass over a W row: 2 x 4 accumulators + loads fit AVX2's 16 registers
constexpr int64_t kW = native::kWidth;

// out[j] = W row . x row j for the group's M rows of x (same arithmetic for any M and position).
template <int M>
inline void dot_group(const float* wr, const float* x, int64_t k, float* out) {
  const int64_t k2 = k / (2 * kW) * (2 * kW);
  vf acc0[M], acc1[M];
  for (int j = 0; j < M; ++j) acc0[j] = acc1[j] = native::broadcast(0.0f);
  for (int64_t i = 0; i < k2; i += 2 * kW) {
    const vf w0 = native::load(wr + i), w1 = native::load(wr + i + kW);
    for (int j = 0; j < M; ++j) {
      acc0[j] = native::fmadd(w0, native::load(x + j * k + i), acc0[j]);
      acc1[j] = native::fmadd(w1, native::load(x + j * k + i + kW), acc1[j]);
    }
  }
  for (int j = 0; j < M; ++j) {
    float s = native::hsum(acc0[j] + acc1[j]);
    for (int64_t i = k2; i < k; ++i) s = std::fma(wr[i], x[j * k + i], s);
    out[j] = s;
  }
}

void gemv_band(const float* x, int64_t m, const float* w, const float* bias, float* y, int64_t k, int64_t n,
               int64_t r0, int64_t r1) {
  float out[kGroup];
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = w + r * k;
    for (int64_t g = 0; g < m; g += kGroup) {  // a later group reads the W row from L1
      const int64_t rows = std::min<int64_t>(kGroup, m - g);
      const float* xg = x + g * k;
      switch (rows) {
        case 1: dot_group<1>(wr, xg, k, out); break;
        case 2: dot_group<2>(wr, xg, k, out); break;
        case 3: dot_group<3>(wr, xg, k, out); break;
        default: dot_group<4>(wr, xg, k, out); break;
      }
      for (int64_t j = 0; j < rows; ++j) y[(g + j) * n + r] = bias != nullptr ? out[j] + bias[r] : out[j];
    }
  }
}

}  // namespace

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_f32: CPU tensors");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32, "gemv_f32: float32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_f32: x [M, K], W [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv_f32: 1 to ", kMaxRows, " rows of x");
  x = x.contiguous();
  w = w.contiguous();
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.scalar_type() == torch::kFloat32 && bias_c.numel() == w.size(0), "gemv_f32: bias [N] float32");
    b = bias_c.data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto y = torch::empty({m, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // A band of at least 64 KB of weights per task: small projections stay on one thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t r0, int64_t r1) { gemv_band(xp, m, wp, b, yp, k, n, r0, r1); });
  return y;
}
