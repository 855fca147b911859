// A mixture-of-experts MLP's experts for a few tokens, bf16, in one call (engine/layers/moe.py).
//
// Why: a decode step of a MoE model routes its tokens to many experts with one or two tokens
// each; the grouped torch path ran two GEMM calls, an activation, a scale and an index_add per
// active expert and layer (docs/PERFORMANCE.md: 64 experts ran at 0.39x the 8-expert model's
// speed at equal active parameters). Here every active expert's gate|up rows, activation, down
// rows and weighted sum run as plain vector loops over the expert's tokens in blocks of up to 8
// (each weight row loaded once per block), the work spread over the threads by output columns,
// so a step costs the routed experts' weight reads and little else.
//
// Roundings follow the torch path (FusedMoE.experts on bf16 tensors): gate and up rounded to
// bf16, silu(gate) * up rounded to bf16, the down product rounded to bf16, times the routing
// weight (fp32) rounded to bf16, added to the token's output in ascending expert order with one
// rounding per add. Only the summation order inside each dot product differs from oneDNN's.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec.h"

namespace asyncllm {

namespace {

using bf16 = c10::BFloat16;

constexpr int kMaxRows = 8;       // tokens of one expert sharing each load of a weight row
constexpr int64_t kColTile = 16;  // output columns per parallel job

inline float round_bf16(float v) { return static_cast<float>(static_cast<bf16>(v)); }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// dots[m] = rows[m] . w over `k` values, for M rows of fp32 (w bf16)
template <int M>
inline void dot_rows(const float* rows, int64_t k, const bf16* w, float* dots) {
  const int64_t kv = k - k % 16;
  v16f acc[M];
  for (int m = 0; m < M; ++m) acc[m] = splat(0.0f);
  for (int64_t i = 0; i < kv; i += 16) {
    const v16f wi = load16(w + i);
    for (int m = 0; m < M; ++m) acc[m] += load16(rows + m * k + i) * wi;
  }
  for (int m = 0; m < M; ++m) {
    float sum = hsum(acc[m]);
    for (int64_t i = kv; i < k; ++i) sum += rows[m * k + i] * static_cast<float>(w[i]);
    dots[m] = sum;
  }
}

void dot_block(const float* rows, int m, int64_t k, const bf16* w, float* dots) {
  switch (m) {
#define DOT_CASE(M) \
  case M: return dot_rows<M>(rows, k, w, dots);
    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#undef DOT_CASE
  }
}

struct Block {
  int64_t expert, first, rows;  // pairs [first, first + rows) of the expert-sorted order
};

}  // namespace

}  // namespace asyncllm

// out[t] = sum over token t's (expert, weight) pairs held here of weight * expert(x[t]).
// x [T, H] bf16; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] bf16; ids [T, K]
// int64 expert ids relative to this rank's first (outside [0, E): another rank's, skipped);
// weights [T, K] fp32. The activation is SiLU (Qwen3-MoE's and Mixtral's).
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor ids,
                          torch::Tensor weights) {
  using asyncllm::bf16;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w13.scalar_type() == torch::kBFloat16 &&
                  w2.scalar_type() == torch::kBFloat16 && x.device().is_cpu(),
              "moe_experts: bf16 tensors on the CPU");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && weights.scalar_type() == torch::kFloat &&
                  ids.sizes() == weights.sizes() && ids.dim() == 2 && ids.size(0) == x.size(0),
              "moe_experts: ids int64 and weights fp32, [T, K] each");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) &&
                  w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 [E, 2I, H], w2 [E, H, I]");
  const torch::Tensor xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
  const torch::Tensor idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t t = xc.size(0), top_k = idc.size(1), hidden = xc.size(1), inter = w2c.size(2), experts = w13c.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  const float* wt = wc.data_ptr<float>();

  // (token, choice) pairs held here, sorted by expert, tokens ascending within one
  std::vector<int64_t> order;
  for (int64_t p = 0; p < t * top_k; ++p)
    if (id[p] >= 0 && id[p] < experts) order.push_back(p);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
  std::vector<asyncllm::Block> blocks;
  for (size_t i = 0; i < order.size();) {
    size_t end = i + 1;
    while (end < order.size() && id[order[end]] == id[order[i]]) ++end;
    for (size_t j = i; j < end; j += asyncllm::kMaxRows)
      blocks.push_back({id[order[i]], static_cast<int64_t>(j),
                        static_cast<int64_t>(std::min<size_t>(asyncllm::kMaxRows, end - j))});
    i = end;
  }
  torch::Tensor out = torch::zeros_like(xc);
  if (order.empty()) return out;
  const int64_t pairs = static_cast<int64_t>(order.size());

  // x widened once per pair (rows of a block are contiguous in this buffer), then h = silu(gate) * up
  std::vector<float> xf(pairs * hidden), h(pairs * inter);
  const bf16* xp = xc.data_ptr<bf16>();
  at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < hidden; ++i) xf[p * hidden + i] = static_cast<float>(xp[order[p] / top_k * hidden + i]);
  });
  const bf16* w13p = w13c.data_ptr<bf16>();
  const int64_t inter_tiles = (inter + asyncllm::kColTile - 1) / asyncllm::kColTile;
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  at::parallel_for(0, nblocks * inter_tiles, 1, [&](int64_t j0, int64_t j1) {
    float gate[asyncllm::kMaxRows], up[asyncllm::kMaxRows];
    for (int64_t job = j0; job < j1; ++job) {
      const asyncllm::Block& b = blocks[job / inter_tiles];
      const int64_t c0 = job % inter_tiles * asyncllm::kColTile, c1 = std::min(inter, c0 + asyncllm::kColTile);
      const float* rows = xf.data() + b.first * hidden;
      const bf16* we = w13p + b.expert * 2 * inter * hidden;
      for (int64_t c = c0; c < c1; ++c) {
        asyncllm::dot_block(rows, static_cast<int>(b.rows), hidden, we + c * hidden, gate);
        asyncllm::dot_block(rows, static_cast<int>(b.rows), hidden, we + (inter + c) * hidden, up);
        for (int64_t m = 0; m < b.rows; ++m) {
          const float g = asyncllm::round_bf16(gate[m]), u = asyncllm::round_bf16(up[m]);
          h[(b.first + m) * inter + c] = asyncllm::round_bf16(asyncllm::silu(g) * u);
        }
      }
    }
  });

  // down rows, scaled and summed per token; a job owns columns of `out`, so experts add in order
  const bf16* w2p = w2c.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t hidden_tiles = (hidden + asyncllm::kColTile - 1) / asyncllm::kColTile;
  at::parallel_for(0, hidden_tiles, 1, [&](int64_t j0, int64_t j1) {
    float down[asyncllm::kMaxRows];
    for (int64_t job = j0; job < j1; ++job) {
      const int64_t c0 = job * asyncllm::kColTile, c1 = std::min(hidden, c0 + asyncllm::kColTile);
      for (const asyncllm::Block& b : blocks) {
        const float* rows = h.data() + b.first * inter;
        const bf16* we = w2p + b.expert * hidden * inter;
        for (int64_t c = c0; c < c1; ++c) {
          asyncllm::dot_block(rows, static_cast<int>(b.rows), inter, we + c * inter, down);
          for (int64_t m = 0; m < b.rows; ++m) {
            const int64_t pair = order[b.first + m];
            const float y = asyncllm::round_bf16(asyncllm::round_bf16(down[m]) * wt[pair]);
            bf16& o = op[pair / top_k * hidden + c];
            o = static_cast<bf16>(static_cast<float>(o) + y);
          }
        }
      }
    }
  });
  return out;
}
