// y = x @ W.T (+ b) for a bf16 weight resident in VNNI pairs: every row count of a bf16 model's
// dense projections on a CPU with AVX512-BF16 (engine/layers/linear.py VnniLinear).
//
// Why: a decode step of a few rows is bound by reading the weights. oneDNN's prepacked bf16
// product read them at 26-37 GB/s for 1 to 8 rows on a 2-core Zen 4 whose two threads stream
// 46-52 GB/s through this loop (docs/PERFORMANCE.md); its own small-row kernel is not what limits
// it, its blocked layout and per-call setup are. A second, GEMV-friendly copy beside the prepacked
// one would double the resident weights, so the one layout serves both: the register-blocked
// kernel of the dequantized tiles (vnni.h) reads it for prefill GEMMs at oneDNN's rate (AVX512-BF16,
// no AMX) and streams it at the memory's rate for a few rows.
//
// Layout: W [N, K] as blocks of 64 output columns, each block B [K/2][64][2] (vnni.h) and all of
// it contiguous: packed [ceil(N/64), K/2, 64, 2], zero columns past N in the last block. One block
// is one sequential stream of K * 128 bytes.
//
// Work split: up to kGemvRows rows of x, the blocks are shared among the threads and each block's
// rows run in one pass over it (two row groups for 7-8 rows, each reading the block from L1/L2 in
// turn). More rows: tiles of blocks of about a core's L2, as many as a multiple of the threads;
// for each group of kKernelRows rows of x, the tile's blocks in turn (x's group stays in L1, the
// tile in L2).
//
// Arithmetic (vnni.h): each output is one fp32 chain in K's order plus the bias, rounded once, the
// same bits for any row count or thread count (deterministic inference needs no padding here).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>

#include "vnni.h"

namespace {

constexpr int64_t kCols = 64;              // output columns per block
constexpr int64_t kGemvRows = 8;           // rows that share one pass over each block
constexpr int64_t kTileBytes = 1 << 20;    // a tile's bytes at most: ~a core's L2
constexpr int64_t kMinTaskBytes = 64 << 10;  // small projections stay on fewer threads

}  // namespace

// Whether vnni_linear is compiled here, and the bf16 dense form to use: on AVX512-BF16 without
// AMX. Where oneDNN has AMX its prepacked GEMM outruns this kernel by several times at prefill
// sizes, so the prepacked form stays there.
bool vnni_linear_built() {
#if defined(ASYNCLLM_VNNI) && !defined(__AMX_BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor vnni_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t n_out) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 &&
                  packed.size(2) == kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "vnni_linear: packed must be contiguous bf16 [ceil(N/64), K/2, 64, 2]");
  const int64_t blocks = packed.size(0), k = packed.size(1) * 2;
  TORCH_CHECK(n_out > (blocks - 1) * kCols && n_out <= blocks * kCols, "vnni_linear: n_out must end in the last block");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.size(1) == k,
              "vnni_linear: x must be bf16 [M, K] on the CPU");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kBFloat16 && b.numel() == n_out, "vnni_linear: bias must be bf16 [N]");
  }
  x = x.contiguous();
  const int64_t m_rows = x.size(0);
  auto y = torch::empty({m_rows, n_out}, x.options());
#if defined(ASYNCLLM_VNNI)
  using asyncllm::vnni::bf16;
  if (m_rows == 0) return y;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  const bf16* bp = b.defined() ? b.data_ptr<bf16>() : nullptr;
  bf16* yp = y.data_ptr<bf16>();
  const int64_t block = k * kCols;  // elements
  // block i's live output columns (the last block may be partial) and its bias
  auto cols = [&](int64_t i) { return std::min(kCols, n_out - i * kCols); };
  auto bias_of = [&](int64_t i) { return bp != nullptr ? bp + i * kCols : nullptr; };
  if (m_rows <= kGemvRows) {
    const int64_t grain = std::max<int64_t>(1, kMinTaskBytes / (block * 2));
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t i = b0; i < b1; ++i) {
        const bf16* w = wp + i * block;
        bf16* out = yp + i * kCols;
        if (m_rows <= asyncllm::vnni::kKernelRows) {
          asyncllm::vnni::group(xp, m_rows, k, w, kCols, cols(i), out, n_out, bias_of(i));
        } else {  // 7-8 rows: two groups of about half (one of 8 would not fit the registers)
          const int64_t half = m_rows / 2;
          asyncllm::vnni::group(xp, half, k, w, kCols, cols(i), out, n_out, bias_of(i));
          asyncllm::vnni::group(xp + half * k, m_rows - half, k, w, kCols, cols(i), out + half * n_out, n_out,
                                bias_of(i));
        }
      }
    });
    return y;
  }
  const int64_t threads = at::get_num_threads();
  int64_t per = std::max<int64_t>(1, kTileBytes / (block * 2));  // blocks per tile
  int64_t tiles = (blocks + per - 1) / per;
  tiles = (tiles + threads - 1) / threads * threads;
  per = (blocks + tiles - 1) / tiles;
  tiles = (blocks + per - 1) / per;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * per, b1 = std::min(blocks, b0 + per);
      for (int64_t m0 = 0; m0 < m_rows; m0 += asyncllm::vnni::kKernelRows) {
        const int64_t rows = std::min<int64_t>(asyncllm::vnni::kKernelRows, m_rows - m0);
        for (int64_t i = b0; i < b1; ++i)
          asyncllm::vnni::group(xp + m0 * k, rows, k, wp + i * block, kCols, cols(i), yp + m0 * n_out + i * kCols,
                                n_out, bias_of(i));
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "vnni_linear: not built for this CPU (needs AVX512-BF16)");
  return y;
#endif
}
