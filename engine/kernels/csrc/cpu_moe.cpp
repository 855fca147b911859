// A mixture-of-experts MLP's experts for a few tokens, bf16 or fp32, in one call
// (engine/layers/moe.py).
//
// Why: a decode step of a MoE model routes its tokens to many experts with one or two tokens
// each; the grouped torch path ran two GEMM calls, an activation, a scale and an index_add per
// active expert and layer (docs/PERFORMANCE.md: 64 experts ran at 0.39x the 8-expert model's
// speed at equal active parameters). Here every active expert's gate|up rows, activation, down
// rows and weighted sum run as plain vector loops over the expert's tokens in blocks of up to 8
// (each weight row loaded once per block), the work spread over the threads as (block, tile of
// 16 weight rows) jobs in expert order, so each thread reads its experts' weights front to back
// (what keeps the hardware prefetchers streaming) and a step costs the routed experts' weight
// reads and little else.
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

template <typename R, typename T>
void dot_block(const R* rows, int m, int64_t k, const T* w, float* dots) {
  switch (m) {
#define DOT_CASE(M) \
  case M: return dot_rows<M>(rows, k, w, dots);
    DOT_CASE(1) DOT_CASE(2) DOT_CASE(3) DOT_CASE(4) DOT_CASE(5) DOT_CASE(6) DOT_CASE(7) DOT_CASE(8)
#undef DOT_CASE
  }
}

// A block's m rows against n <= kColTile weight rows a[j] = wa + j * k, and as many b[j] = wb + j *
// k where wb is given: da[r * kColTile + j] = rows[r] . a[j], db likewise. a[j] and b[j] are read
// one after the other, so the two regions stream front to back side by side.
template <typename R, typename T>
void block_dots(const R* rows, int m, int64_t k, const T* wa, const T* wb, int64_t n, float* da, float* db) {
  float col[kMaxRows];
  for (int64_t j = 0; j < n; ++j) {
    dot_block(rows, m, k, wa + j * k, col);
    for (int r = 0; r < m; ++r) da[r * kColTile + j] = col[r];
    if (!wb) continue;
    dot_block(rows, m, k, wb + j * k, col);
    for (int r = 0; r < m; ++r) db[r * kColTile + j] = col[r];
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// bf16 rows against bf16 weights with AVX512-BF16's dot product: 32 weights an instruction with no
// widening, where the fp32 loop widened each weight and spent an FMA per 16. Exact products, fp32
// sums.
constexpr bool kBf16Rows = true;

// lane j = the sum of v[j]'s 16 lanes: four rounds, each adding two vectors' halves side by side
inline __m512 sum_each(const __m512* v) {
  __m512 s[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: v[2i] in chunks 0-1, v[2i+1] in chunks 2-3
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunks: chunk c holds v[4i + c]
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // within chunk c: lanes 0-1 v[8i + c], lanes 2-3 v[8i + 4 + c]
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  // lane 4c + j holds v[4j + c]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// The M rows against S weight rows (w[0], w[1]) read side by side, front to back: out[s][r * 16] =
// the lanes of rows[r] . w[s], not yet added up. U partial sums a pair keep ~8 product chains in
// flight (one chain a row waited on the instruction's latency at 1-3 rows an expert).
template <int M, int S>
inline void lane_dots(const bf16* rows, int64_t k, const bf16* const* w, __m512* const* out) {
  constexpr int U = std::min(4, std::max(1, 8 / (M * S)));
  const int64_t ku = k - k % (32 * U);
  __m512 acc[S][M][U];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < M; ++r)
      for (int u = 0; u < U; ++u) acc[s][r][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < ku; i += 32 * U)
    for (int u = 0; u < U; ++u) {
      __m512bh x[M];
      for (int r = 0; r < M; ++r) x[r] = (__m512bh)_mm512_loadu_si512(rows + r * k + i + 32 * u);
      for (int s = 0; s < S; ++s) {
        const __m512bh ws = (__m512bh)_mm512_loadu_si512(w[s] + i + 32 * u);
        for (int r = 0; r < M; ++r) acc[s][r][u] = _mm512_dpbf16_ps(acc[s][r][u], x[r], ws);
      }
    }
  for (int64_t i = ku; i < k; i += 32) {  // whole vectors past the unrolled part, then the tail masked
    const __mmask32 part = i + 32 <= k ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (k - i)) - 1);
    __m512bh x[M];
    for (int r = 0; r < M; ++r) x[r] = (__m512bh)_mm512_maskz_loadu_epi16(part, rows + r * k + i);
    for (int s = 0; s < S; ++s) {
      const __m512bh ws = (__m512bh)_mm512_maskz_loadu_epi16(part, w[s] + i);
      for (int r = 0; r < M; ++r) acc[s][r][0] = _mm512_dpbf16_ps(acc[s][r][0], x[r], ws);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < M; ++r) {
      __m512 sum = acc[s][r][0];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[s][r][u]);
      out[s][r * 16] = sum;
    }
}

template <int M>
void block_dots_of(const bf16* rows, int64_t k, const bf16* wa, const bf16* wb, int64_t n, float* da, float* db) {
  __m512 va[M * 16], vb[M * 16];  // (row r, weight row j) at r * 16 + j
  for (int64_t j = 0; j < n; ++j) {
    const bf16* w[2] = {wa + j * k, wb ? wb + j * k : nullptr};
    __m512* out[2] = {va + j, vb + j};
    if (wb)
      lane_dots<M, 2>(rows, k, w, out);
    else
      lane_dots<M, 1>(rows, k, w, out);
  }
  for (int r = 0; r < M; ++r) {
    for (int64_t j = n; j < 16; ++j) va[r * 16 + j] = vb[r * 16 + j] = _mm512_setzero_ps();
    _mm512_storeu_ps(da + r * kColTile, sum_each(va + r * 16));
    if (wb) _mm512_storeu_ps(db + r * kColTile, sum_each(vb + r * 16));
  }
}

template <>
void block_dots(const bf16* rows, int m, int64_t k, const bf16* wa, const bf16* wb, int64_t n, float* da, float* db) {
  switch (m) {
#define BLOCK_CASE(M) \
  case M: return block_dots_of<M>(rows, k, wa, wb, n, da, db);
    BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7) BLOCK_CASE(8)
#undef BLOCK_CASE
  }
}
#else
constexpr bool kBf16Rows = false;
#endif

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
    float gate[kMaxRows * kColTile], up[kMaxRows * kColTile];
    for (int64_t job = j0; job < j1; ++job) {
      const Block& b = blocks[job / inter_tiles];
      const int64_t c0 = job % inter_tiles * kColTile, n = std::min(inter - c0, kColTile);
      const T* we = w13p + b.expert * 2 * inter * hidden;
      block_dots(xf.data() + b.first * hidden, static_cast<int>(b.rows), hidden, we + c0 * hidden,
                 we + (inter + c0) * hidden, n, gate, up);
      for (int64_t m = 0; m < b.rows; ++m)
        for (int64_t j = 0; j < n; ++j) {
          const float g = held<T>(gate[m * kColTile + j]), u = held<T>(up[m * kColTile + j]);
          h[(b.first + m) * inter + c0 + j] = static_cast<R>(held<T>(silu(g) * u));
        }
    }
  });

  // down rows, jobs as above (a job owning output columns across every expert, which kept the sum
  // order by construction, read 8 KB pieces 512 KB apart and streamed at half the rate); every
  // pair's scaled product goes to `y`, then each token adds its pairs in ascending expert order
  const T* w2p = w2c.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t hidden_tiles = (hidden + kColTile - 1) / kColTile;
  std::vector<float> y(pairs * hidden);
  at::parallel_for(0, nblocks * hidden_tiles, 1, [&](int64_t j0, int64_t j1) {
    float down[kMaxRows * kColTile];
    for (int64_t job = j0; job < j1; ++job) {
      const Block& b = blocks[job / hidden_tiles];
      const int64_t c0 = job % hidden_tiles * kColTile, n = std::min(hidden - c0, kColTile);
      block_dots(h.data() + b.first * inter, static_cast<int>(b.rows), inter,
                 w2p + (b.expert * hidden + c0) * inter, static_cast<const T*>(nullptr), n, down, nullptr);
      for (int64_t m = 0; m < b.rows; ++m) {
        const float scale = wt[order[b.first + m]];
        for (int64_t j = 0; j < n; ++j)
          y[(b.first + m) * hidden + c0 + j] = held<T>(held<T>(down[m * kColTile + j]) * scale);
      }
    }
  });
  // token t's pairs, positions in the routing's order (ascending expert)
  std::vector<int64_t> first(t + 1, 0), position(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++first[order[p] / top_k + 1];
  for (int64_t i = 0; i < t; ++i) first[i + 1] += first[i];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) position[next[order[p] / top_k]++] = p;
  at::parallel_for(0, t, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tok = t0; tok < t1; ++tok) {
      T* o = op + tok * hidden;
      for (int64_t i = first[tok]; i < first[tok + 1]; ++i) {
        const float* yp = y.data() + position[i] * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] = static_cast<T>(static_cast<float>(o[c]) + yp[c]);
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
