// A mixture-of-experts MLP's experts for a few tokens, bf16 or fp32, in one call
// (engine/layers/moe.py).
//
// Why: a decode step of a MoE model routes its tokens to many experts with one or two tokens
// each; the grouped torch path ran two GEMM calls, an activation, a scale and an index_add per
// active expert and layer (docs/PERFORMANCE.md: 64 experts ran at 0.39x the 8-expert model's
// speed at equal active parameters). Here every active expert's gate|up rows, activation, down
// rows and weighted sum run as plain vector loops over the expert's tokens in blocks of up to 8
// (each weight row loaded once per block), the work spread over the threads by output columns,
// so a step costs the routed experts' weight reads and little else.
//
// Roundings follow the torch path (FusedMoE.experts). bf16: gate and up rounded to bf16,
// silu(gate) * up rounded to bf16, the down product rounded to bf16, times the routing weight
// (fp32) rounded to bf16, added to the token's output in ascending expert order with one rounding
// per add. fp32: the same steps with nothing to round. Only the summation order inside each dot
// product differs from the GEMM libraries' (and, in fp32, exp's last bit inside SiLU). bf16 on
// AVX512-BF16 multiplies bf16 rows by the bf16 weights with its dot-product instruction (exact
// products, fp32 sums; subnormal inputs count as zero, as in oneDNN's bf16 kernels).
//
// Experts kept in a GGUF's blocks run in cpu_moe_quant.cpp instead.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "vec_native.h"

// The product of the routing weight and the sum into the output are two roundings, as in torch.
#pragma GCC optimize("fp-contract=off")

namespace asyncllm {

namespace {

using bf16 = c10::BFloat16;

constexpr int kMaxRows = 8;       // tokens of one expert sharing each load of a weight row
constexpr int64_t kColTile = 16;  // output columns per parallel job

inline float round_bf16(float v) { return static_cast<float>(static_cast<bf16>(v)); }

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// dots[m] = rows[m] . w over `k` values, for M rows of fp32 (w bf16 or fp32); vectors of the
// machine's width (an AVX2 machine kept 16-lane accumulators in memory)
template <int M, typename T>
inline void dot_rows(const float* rows, int64_t k, const T* w, float* dots) {
  using native::vf;
  constexpr int kW = native::kWidth;
  const int64_t kv = k - k % kW;
  vf acc[M];
  for (int m = 0; m < M; ++m) acc[m] = native::broadcast(0.0f);
  for (int64_t i = 0; i < kv; i += kW) {
    const vf wi = native::load(w + i);
    for (int m = 0; m < M; ++m) acc[m] = native::fmadd(native::load(rows + m * k + i), wi, acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float sum = native::hsum(acc[m]);
    for (int64_t i = kv; i < k; ++i) sum += rows[m * k + i] * static_cast<float>(w[i]);
    dots[m] = sum;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// bf16 rows against bf16 weights with AVX512-BF16's dot product: 32 weights an instruction with no
// widening, where the fp32 loop widened each weight and spent an FMA per 16 (past ~2 rows an
// expert the loop was compute-bound: docs/PERFORMANCE.md). Exact products, fp32 sums.
constexpr bool kBf16Rows = true;

template <int M>
inline void dot_rows(const bf16* rows, int64_t k, const bf16* w, float* dots) {
  const int64_t kv = k - k % 32;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < kv; i += 32) {
    const __m512bh wi = (__m512bh)_mm512_loadu_si512(w + i);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(rows + m * k + i), wi);
  }
  for (int m = 0; m < M; ++m) {
    float sum = _mm512_reduce_add_ps(acc[m]);
    for (int64_t i = kv; i < k; ++i) sum += static_cast<float>(rows[m * k + i]) * static_cast<float>(w[i]);
    dots[m] = sum;
  }
}
#else
constexpr bool kBf16Rows = false;
#endif

template <typename R, typename T>
void dot_block(const R* rows, int m, int64_t k, const T* w, float* dots) {
  switch (m) {
#define DOT_CASE(M) \
  case M: return dot_rows<M>(rows, k, w, dots);
    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#undef DOT_CASE
  }
}

// The rows' type: bf16 where its dot-product loop is built, else fp32 (exact either way)
template <typename T>
using RowsOf = std::conditional_t<std::is_same_v<T, bf16> && kBf16Rows, bf16, float>;

// A value as the torch path holds it: bf16 rounds, fp32 keeps
template <typename T>
inline float held(float v) {
  if constexpr (std::is_same_v<T, bf16>) return round_bf16(v);
  return v;
}

struct Block {
  int64_t expert, first, rows;  // pairs [first, first + rows) of the expert-sorted order
};

// The (token, choice) pairs of experts held here ([0, experts) of ids [T, K]), sorted by expert,
// tokens ascending within one, cut into blocks of up to kMaxRows pairs of one expert.
struct Routing {
  std::vector<int64_t> order;  // pair index t * K + choice
  std::vector<Block> blocks;

  Routing(const int64_t* id, int64_t pairs, int64_t experts) {
    for (int64_t p = 0; p < pairs; ++p)
      if (id[p] >= 0 && id[p] < experts) order.push_back(p);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    for (size_t i = 0; i < order.size();) {
      size_t end = i + 1;
      while (end < order.size() && id[order[end]] == id[order[i]]) ++end;
      for (size_t j = i; j < end; j += kMaxRows)
        blocks.push_back({id[order[i]], static_cast<int64_t>(j),
                          static_cast<int64_t>(std::min<size_t>(kMaxRows, end - j))});
      i = end;
    }
  }
};

void check_routing(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && weights.scalar_type() == torch::kFloat &&
                  ids.sizes() == weights.sizes() && ids.dim() == 2 && ids.size(0) == x.size(0),
              "moe_experts: ids int64 and weights fp32, [T, K] each");
}

// x's rows of every pair, in the routing's order, as R (a block's rows are contiguous)
template <typename R, typename T>
std::vector<R> gather_rows(const T* xp, const Routing& r, int64_t top_k, int64_t hidden) {
  const int64_t pairs = static_cast<int64_t>(r.order.size());
  std::vector<R> xf(pairs * hidden);
  at::parallel_for(0, pairs, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t i = 0; i < hidden; ++i) xf[p * hidden + i] = static_cast<R>(xp[r.order[p] / top_k * hidden + i]);
  });
  return xf;
}

template <typename T>
torch::Tensor experts_of(const torch::Tensor& x, const torch::Tensor& w13, const torch::Tensor& w2,
                         const torch::Tensor& ids, const torch::Tensor& weights) {
  check_routing(x, ids, weights);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) &&
                  w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 [E, 2I, H], w2 [E, H, I]");
  const torch::Tensor xc = x.contiguous(), w13c = w13.contiguous(), w2c = w2.contiguous();
  const torch::Tensor idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t t = xc.size(0), top_k = idc.size(1), hidden = xc.size(1), inter = w2c.size(2), experts = w13c.size(0);
  const float* wt = wc.data_ptr<float>();
  const Routing routing(idc.data_ptr<int64_t>(), t * top_k, experts);
  const std::vector<int64_t>& order = routing.order;
  const std::vector<Block>& blocks = routing.blocks;
  torch::Tensor out = torch::zeros_like(xc);
  if (order.empty()) return out;
  const int64_t pairs = static_cast<int64_t>(order.size());

  using R = RowsOf<T>;
  const std::vector<R> xf = gather_rows<R>(xc.data_ptr<T>(), routing, top_k, hidden);
  std::vector<R> h(pairs * inter);
  const T* w13p = w13c.data_ptr<T>();
  const int64_t inter_tiles = (inter + kColTile - 1) / kColTile;
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  at::parallel_for(0, nblocks * inter_tiles, 1, [&](int64_t j0, int64_t j1) {
    float gate[kMaxRows], up[kMaxRows];
    for (int64_t job = j0; job < j1; ++job) {
      const Block& b = blocks[job / inter_tiles];
      const int64_t c0 = job % inter_tiles * kColTile, c1 = std::min(inter, c0 + kColTile);
      const R* rows = xf.data() + b.first * hidden;
      const T* we = w13p + b.expert * 2 * inter * hidden;
      for (int64_t c = c0; c < c1; ++c) {
        dot_block(rows, static_cast<int>(b.rows), hidden, we + c * hidden, gate);
        dot_block(rows, static_cast<int>(b.rows), hidden, we + (inter + c) * hidden, up);
        for (int64_t m = 0; m < b.rows; ++m) {
          const float g = held<T>(gate[m]), u = held<T>(up[m]);
          h[(b.first + m) * inter + c] = static_cast<R>(held<T>(silu(g) * u));
        }
      }
    }
  });

  // down rows, scaled and summed per token; a job owns columns of `out`, so experts add in order
  const T* w2p = w2c.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hidden_tiles = (hidden + kColTile - 1) / kColTile;
  at::parallel_for(0, hidden_tiles, 1, [&](int64_t j0, int64_t j1) {
    float down[kMaxRows];
    for (int64_t job = j0; job < j1; ++job) {
      const int64_t c0 = job * kColTile, c1 = std::min(hidden, c0 + kColTile);
      for (const Block& b : blocks) {
        const R* rows = h.data() + b.first * inter;
        const T* we = w2p + b.expert * hidden * inter;
        for (int64_t c = c0; c < c1; ++c) {
          dot_block(rows, static_cast<int>(b.rows), inter, we + c * inter, down);
          for (int64_t m = 0; m < b.rows; ++m) {
            const int64_t pair = order[b.first + m];
            const float y = held<T>(held<T>(down[m]) * wt[pair]);
            T& o = op[pair / top_k * hidden + c];
            o = static_cast<T>(static_cast<float>(o) + y);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace asyncllm

// out[t] = sum over token t's (expert, weight) pairs held here of weight * expert(x[t]).
// x [T, H], w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], all bf16 or all fp32; ids
// [T, K] int64 expert ids relative to this rank's first (outside [0, E): another rank's, skipped);
// weights [T, K] fp32. The activation is SiLU (Qwen3-MoE's and Mixtral's).
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor ids,
                          torch::Tensor weights) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kBFloat16 || dtype == torch::kFloat) && w13.scalar_type() == dtype &&
                  w2.scalar_type() == dtype && x.device().is_cpu(),
              "moe_experts: bf16 or fp32 tensors, one dtype, on the CPU");
  if (dtype == torch::kFloat) return asyncllm::experts_of<float>(x, w13, w2, ids, weights);
  return asyncllm::experts_of<asyncllm::bf16>(x, w13, w2, ids, weights);
}
