// Fused elementwise ops of a decoder layer, bf16 on CPUs: RMSNorm (optionally after the residual
// add), SiLU(gate) * up, and rotary embedding; for Gemma's layers, its (1 + w) RMSNorm (alone and
// as the sandwich step "residual += norm(y), then the next norm") and GELU-tanh(gate) * up.
//
// Why: torch runs transformers' RMSNorm as seven ops (to fp32, pow, mean, add, rsqrt, mul, to bf16,
// mul) and SiLU-and-mul as two, each a pass over memory with its own dispatch; on the default
// model they took ~10% of a bf16 workload. Here each is one pass per row.
//
// Rounding follows transformers' bf16 op order: the normalised row is rounded to bf16 before the
// weight multiply, whose product is rounded again; silu(gate) is rounded to bf16 before the
// multiply by up; a residual sum is rounded to bf16; rotary rounds x*cos and x'*sin, then their
// sum (so it is bit-identical to torch's three bf16 ops). Sums of squares are fp32 in a different order
// than torch's mean, so a bf16 result can differ from torch's by one rounding step (fp32 models
// keep the torch ops: their greedy output is token-identical to transformers').

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <optional>
#include <vector>

#include "vec.h"

using namespace asyncllm;
using bf16 = c10::BFloat16;

namespace {

// Rows per parallel task: about 16K elements, so small (decode) inputs stay on one thread.
int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)); }

// bf16(x): one rounding, as torch's bf16 ops do (round to nearest even).
inline v16f round_bf16(v16f x) {
  alignas(64) bf16 tmp[16];
  store16(x, tmp);
  return load16(tmp);
}

// 1 / sqrt(mean(x^2) + eps) of one row of n (a multiple of 16) values, sums of squares in fp32.
inline float inv_rms(const bf16* x, int64_t n, float eps) {
  v16f ss = splat(0.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const v16f v = load16(x + i);
    ss += v * v;
  }
  return 1.0f / std::sqrt(hsum(ss) / static_cast<float>(n) + eps);
}

// out = w * bf16(x * rsqrt(mean(x^2) + eps)) for one row of n (a multiple of 16) values.
inline void rms_norm_row(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; i += 16) store16(load16(w + i) * round_bf16(load16(x + i) * r), out + i);
}

// Gemma's RMSNorm: out = bf16(x * rsqrt(mean(x^2) + eps) * (1 + w)), the scale applied in fp32
// before the one rounding (transformers' Gemma order; its weight is an offset from 1).
inline void unit_norm_row(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  const float r = inv_rms(x, n, eps);
  for (int64_t i = 0; i < n; i += 16) store16(load16(x + i) * r * (1.0f + load16(w + i)), out + i);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, op, ": bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.dim() == 1 && w.is_contiguous(), op,
              ": x [T, N] contiguous, weight [N]");
  TORCH_CHECK(w.size(0) == x.size(1) && x.size(1) % 16 == 0, op, ": weight size must be N, N a multiple of 16");
}

// `row_norm` (rms_norm_row or unit_norm_row) of every row of x into a new tensor.
template <typename RowNorm>
torch::Tensor norm_rows(const torch::Tensor& x, const torch::Tensor& w, double eps, const char* op,
                        const RowNorm& row_norm) {
  check_rows(x, w, op);
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), N = x.size(1);
  const bf16 *xp = x.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  at::parallel_for(0, T, grain_rows(N), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) row_norm(xp + t * N, wp, o + t * N, N, static_cast<float>(eps));
  });
  return out;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  return norm_rows(x, w, eps, "rms_norm", rms_norm_row);
}

// x <- bf16(x + y) in place (the residual stream), then returns rms_norm(x).
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  check_rows(x, w, "add_rms_norm_");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() && y.is_contiguous() && y.device().is_cpu(),
              "add_rms_norm_: y like x");
  auto out = torch::empty_like(x);
  const int64_t T = x.size(0), N = x.size(1);
  bf16* xp = x.data_ptr<bf16>();
  const bf16 *yp = y.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, grain_rows(N), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      bf16* xr = xp + t * N;
      for (int64_t i = 0; i < N; i += 16) store16(load16(xr + i) + load16(yp + t * N + i), xr + i);
      rms_norm_row(xr, wp, op + t * N, N, static_cast<float>(eps));
    }
  });
  return out;
}

torch::Tensor rms_norm_unit_offset(torch::Tensor x, torch::Tensor w, double eps) {
  return norm_rows(x, w, eps, "rms_norm_unit_offset", unit_norm_row);
}

// Each head of x [T, NH, D] (rows of D contiguous, any token stride: the q|k slab of a fused
// q|k|v projection) normalised with its own weight row table[h] ([NH, D]: Qwen3's q and k norm
// weights, Gemma 3's offsets from 1 when `unit_offset`), into a new contiguous [T, NH, D].
torch::Tensor rms_norm_heads(torch::Tensor x, torch::Tensor table, double eps, bool unit_offset) {
  TORCH_CHECK(x.device().is_cpu() && table.device().is_cpu(), "rms_norm_heads: CPU tensors");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && table.scalar_type() == torch::kBFloat16,
              "rms_norm_heads: bfloat16 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rms_norm_heads: x [T, NH, D], heads packed");
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.size(0) == x.size(1) && table.size(1) == x.size(2),
              "rms_norm_heads: table [NH, D] contiguous");
  TORCH_CHECK(x.size(2) % 16 == 0, "rms_norm_heads: D must be a multiple of 16");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), ts = x.stride(0);
  auto out = torch::empty({T, NH, D}, x.options());
  const bf16 *xp = x.data_ptr<bf16>(), *wp = table.data_ptr<bf16>();
  bf16* o = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T * NH, grain_rows(D), [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const int64_t t = i / NH, h = i % NH;
      if (unit_offset)
        unit_norm_row(xp + t * ts + h * D, wp + h * D, o + i * D, D, e);
      else
        rms_norm_row(xp + t * ts + h * D, wp + h * D, o + i * D, D, e);
    }
  });
  return out;
}

// Gemma's sandwich step: x <- bf16(x + unit_norm(y, w)) in place (the residual stream: the norm
// rounded to bf16, then the sum, as torch's two ops), then returns unit_norm(x, w_next); with no
// w_next, x itself.
torch::Tensor add_unit_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, std::optional<torch::Tensor> w_next,
                             double eps) {
  check_rows(x, w, "add_unit_norm_");
  if (w_next.has_value()) check_rows(x, *w_next, "add_unit_norm_");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() && y.is_contiguous() && y.device().is_cpu(),
              "add_unit_norm_: y like x");
  const int64_t T = x.size(0), N = x.size(1);
  auto out = w_next.has_value() ? torch::empty_like(x) : x;
  bf16* xp = x.data_ptr<bf16>();
  const bf16 *yp = y.data_ptr<bf16>(), *wp = w.data_ptr<bf16>();
  const bf16* np = w_next.has_value() ? w_next->data_ptr<bf16>() : nullptr;
  bf16* op = out.data_ptr<bf16>();
  const float ep = static_cast<float>(eps);
  at::parallel_for(0, T, grain_rows(N), [&](int64_t b, int64_t e) {
    std::vector<bf16> normed(N);
    for (int64_t t = b; t < e; ++t) {
      bf16* xr = xp + t * N;
      unit_norm_row(yp + t * N, wp, normed.data(), N, ep);
      for (int64_t i = 0; i < N; i += 16) store16(load16(xr + i) + load16(normed.data() + i), xr + i);
      if (np != nullptr) unit_norm_row(xr, np, op + t * N, N, ep);
    }
  });
  return out;
}

namespace {

// gate_up [T, 2I] (gate | up) -> bf16(bf16(act(gate)) * up) [T, I], act on fp32 vectors.
template <typename Act>
torch::Tensor gated_mul(const torch::Tensor& gate_up, const char* op, const Act& act) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.scalar_type() == torch::kBFloat16, op, ": CPU bfloat16");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 32 == 0, op,
              ": [T, 2I] contiguous, I a multiple of 16");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = torch::empty({T, I}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* op_ = out.data_ptr<bf16>();
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t i = 0; i < I; i += 16) {
        const v16f g = load16(gp + t * 2 * I + i), u = load16(gp + t * 2 * I + I + i);
        store16(round_bf16(act(g)) * u, op_ + t * I + i);
      }
  });
  return out;
}

}  // namespace

// SiLU-and-mul. silu(g) = g / (1 + exp(-g)) as torch computes it, from e = exp(-|g|) <= 1 so
// nothing overflows: g / (1 + e) for g >= 0, g * e / (1 + e) below.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  return gated_mul(gate_up, "silu_mul", [](v16f g) {
    const v16f e = exp_nonpos(g > 0.0f ? -g : g);
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
  });
}

// Gemma's GeGLU: gelu_tanh(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3), computed
// as g / (1 + exp(-2y)) from e = exp(-2|y|), as silu is: the same function without the
// cancellation of 1 + tanh(y) for y << 0 (torch's fp32 form loses every digit there, at values
// below ~1e-6).
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f;  // sqrt(2 / pi), torch's constants
  return gated_mul(gate_up, "gelu_tanh_mul", [](v16f g) {
    const v16f y = kBeta * (g + kKappa * g * g * g);
    const v16f e = exp_nonpos(y > 0.0f ? -2.0f * y : 2.0f * y);
    return (y >= 0.0f ? g : g * e) / (1.0f + e);
  });
}

// Rotary embedding of x [T, NH, D] (rows may be strided: a view into the fused qkv output) with
// cos / signed sin [T, D] (engine/layers/rotary.py): bf16(bf16(x * cos) + bf16(swap(x) * sin)),
// swap(x) = (x2, x1), as a new contiguous [T, NH, D].
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "rotary: CPU tensors");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && cos.scalar_type() == torch::kBFloat16 &&
                  sin.scalar_type() == torch::kBFloat16,
              "rotary: bfloat16 only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x [T, NH, D], rows of D contiguous");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 32 == 0, "rotary: head_dim a multiple of 32");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == D &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos/sin [T, D] contiguous");
  auto out = torch::empty({T, NH, D}, x.options());
  const bf16 *xp = x.data_ptr<bf16>(), *cp = cos.data_ptr<bf16>(), *sp = sin.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, grain_rows(NH * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < NH; ++h) {
        const bf16* xr = xp + t * xs + h * D;
        bf16* o = op + (t * NH + h) * D;
        for (int64_t i = 0; i < D; i += 16) {
          const v16f a = round_bf16(load16(xr + i) * load16(cp + t * D + i));
          const v16f sw = load16(xr + (i < half ? i + half : i - half));
          store16(a + round_bf16(sw * load16(sp + t * D + i)), o + i);
        }
      }
  });
  return out;
}
