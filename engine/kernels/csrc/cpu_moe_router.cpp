// A mixture-of-experts layer's router logits on the CPU, for FusedMoE.route and the fused decode
// loop alike (both call moe_router_logits, so the two paths stay bit-identical).
//
// Why: a bf16 decode step routes each layer's few tokens through a [E, H] weight (128 x 1024:
// 256 KB). oneDNN's prepacked product spent ~27 us a call on it from a cold cache (~20 us hot)
// for ~130k multiply-adds, 12 calls a step of a 12-layer model: ~8% of a Q4_K_M MoE model's
// single-stream step (docs/PERFORMANCE.md). This loop reads each weight row once per row of x
// with AVX512-BF16 dot products (~9 us a call cold).
//
// Which product: bf16 x of at most kRouterRows rows on a CPU with AVX512-BF16 takes the loop;
// larger forwards (prefill) keep the prepacked oneDNN form (a GEMM there), and without one
// at::linear runs (fp32 models, CPUs without oneDNN's bf16).
//
// Arithmetic: products exact, each logit summed in fp32 over two interleaved 32-value chains in
// a fixed order (independent of the thread split and of the other rows), rounded to bf16 once.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <optional>

#include "decode_layers.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ASYNCLLM_ROUTER_LOOP 1
#endif

namespace asyncllm {

namespace {

constexpr int64_t kRouterRows = 4;  // decode steps of a few streams; above, oneDNN's GEMM

#ifdef ASYNCLLM_ROUTER_LOOP
using bf16 = c10::BFloat16;

// y[m, e] for experts [e0, e1): two chains of 32-value dot products, then one horizontal sum.
void router_rows(const bf16* x, int64_t rows, const bf16* w, int64_t h, bf16* y, int64_t experts, int64_t e0,
                 int64_t e1) {
  for (int64_t e = e0; e < e1; ++e) {
    const bf16* we = w + e * h;
    for (int64_t m = 0; m < rows; ++m) {
      const bf16* xm = x + m * h;
      __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
      for (int64_t k = 0; k < h; k += 64) {
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(xm + k), (__m512bh)_mm512_loadu_si512(we + k));
        b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512(xm + k + 32),
                             (__m512bh)_mm512_loadu_si512(we + k + 32));
      }
      y[m * experts + e] = static_cast<bf16>(_mm512_reduce_add_ps(_mm512_add_ps(a, b)));
    }
  }
}
#endif

}  // namespace

torch::Tensor moe_router_logits(const torch::Tensor& x, const torch::Tensor& gate,
                                const std::optional<torch::Tensor>& packed) {
  TORCH_CHECK(x.dim() == 2 && gate.dim() == 2 && x.size(1) == gate.size(1), "moe_router_logits: x [T, H], gate [E, H]");
  if (!packed.has_value()) return at::linear(x, gate);
#ifdef ASYNCLLM_ROUTER_LOOP
  const int64_t rows = x.size(0), h = x.size(1), experts = gate.size(0);
  if (rows <= kRouterRows && x.scalar_type() == torch::kBFloat16 && gate.scalar_type() == torch::kBFloat16 &&
      x.device().is_cpu() && h % 64 == 0) {
    const torch::Tensor xc = x.contiguous(), wc = gate.contiguous();
    auto y = torch::empty({rows, experts}, x.options());
    const bf16* xp = xc.data_ptr<bf16>();
    const bf16* wp = wc.data_ptr<bf16>();
    bf16* yp = y.data_ptr<bf16>();
    // ~64 KB of the weight a task: a small router runs on the calling thread
    at::parallel_for(0, experts, std::max<int64_t>(1, (64 << 10) / (2 * h)),
                     [&](int64_t e0, int64_t e1) { router_rows(xp, rows, wp, h, yp, experts, e0, e1); });
    return y;
  }
#endif
  return dense_linear(x, *packed, torch::Tensor());
}

}  // namespace asyncllm
