// Multi-LoRA deltas on a CPU: for each token whose request runs an adapter,
// y[t] += expand(scale * shrink(x[t])) for every part of the projection. bf16 and fp32 models call
// it inside the fused layer loop (cpu_decode_layers.cpp) and from the Python layers
// (engine/lora/ops.py).
//
// Why here: a forward with adapter rows used to leave the C++ loop for the Python layers, and on
// the default model that cost more than the LoRA arithmetic itself; in fp32 the torch ops' batched
// form copied every adapter's weights on every call (docs/PERFORMANCE.md, LoRA). A decode step's
// LoRA work is a few hundred small products (rank <= 64), so this runs them as plain vector loops,
// no ATen op per adapter and projection: the rows of one adapter in blocks, each block reading the
// adapter's A and Bt once (re-reading them per row cost more than the arithmetic), the blocks
// spread over the threads. Measured on shapes of the default model, a prefill's rows ran as fast
// through these loops as through gathered oneDNN GEMMs, so every row count takes them. (Blocks of
// 32 rows running each slice of A and Bt over tiles of 4, so that the weights are read once per
// 32 rows, were no faster on an AVX2 EPYC, also on a 1B model's shapes: docs/PERFORMANCE.md.)
//
// Layout (engine/lora/pool.py `pack` writes it): the weights are stored in groups of the summed
// dimension that fill 32 bits (two bf16 values, one fp32), A as [slots, in/G, ranks, G] and Bt as
// [slots, ranks/G, out, G], so one vector load holds G summed-over elements for a vector's worth of
// outputs: the shrink's rank outputs sit in the vector's lanes (no horizontal sums), the expand's
// in output columns, and each input value is broadcast once per vector of outputs. `ranks` is P*R
// rounded up to 16; its padding holds zeros.
//
// The arithmetic and its roundings follow engine/lora/ops.py `add_lora_deltas` (the torch path):
// the shrink x @ A.T accumulated in fp32 and rounded to the model's dtype, times the per-rank-column
// scaling in fp32, rounded to that dtype; the expand h @ Bt accumulated in fp32 and added to the
// output with one rounding. bf16 products are exact in fp32, so in bf16 only the summation order
// differs from oneDNN's. The multiply-adds are written out (native::fmadd), so a row's bits do not
// depend on which inlined copy of a loop ran it.

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "decode_layers.h"
#include "vec_native.h"

namespace asyncllm {

namespace {

using bf16 = c10::BFloat16;

// The kernel's vectors are the machine's own width (vec_native.h): 16 fp32 lanes with AVX-512, 8
// with AVX2, where 16-lane vectors were kept in memory between operations. A tile is up to
// kMaxRows rows of one adapter (sharing each load of its A and Bt) times kTile vectors of outputs,
// sized so its accumulators, weights and broadcasts stay in the registers (32 with AVX-512, 16
// with AVX2).
using native::broadcast;
using native::fmadd;
using native::kWidth;
using native::vf;
using native::vu;
#if defined(__AVX512F__)
constexpr int kMaxRows = 8, kTile = 2;
#else
constexpr int kMaxRows = 4, kTile = 2;
#endif
constexpr int kLanes = 16;  // the pool pads the ranks to a multiple of this (>= kWidth)

// How many summed-over values one 32-bit lane of the packed weights holds.
template <typename T>
constexpr int kGroup = 4 / sizeof(T);

// kWidth bf16 pairs widened to fp32: out[0] holds each pair's first element, out[1] its second.
inline void load_group(const bf16* w, vf (&out)[2]) {
  vu u;
  std::memcpy(&u, w, sizeof(u));
  const vu lo = u << 16, hi = u & 0xffff0000u;  // bf16 is the top half of an fp32
  std::memcpy(&out[0], &lo, sizeof(lo));
  std::memcpy(&out[1], &hi, sizeof(hi));
}

inline void load_group(const float* w, vf (&out)[1]) { std::memcpy(&out[0], w, sizeof(vf)); }

// y[0, n) += sums (n a multiple of kLanes), rounded once to y's dtype.
inline void add_row(bf16* y, const float* sums, int n) {
  for (int c = 0; c < n; c += kLanes) store16(load16(y + c) + load16(sums + c), y + c);
}

inline void add_row(float* y, const float* sums, int n) {
  for (int c = 0; c < n; ++c) y[c] += sums[c];
}

// acc[m][j0 + W*v + lane] = sum over k of x[m][k] * A[k][j0 + W*v + lane], JV vectors of ranks.
// xw: each row widened to fp32, G * groups values (padded with 0); a: [groups][ranks][G].
// The tiles are never inlined: inlined into their caller (GCC did so for fp32), the tile's
// accumulators went to the stack and fp32 LoRA ran 1.5x slower (prefill rows 1.6x).
template <typename T, int M, int JV>
[[gnu::noinline]] void shrink_tile(const float* xw, int64_t groups, const T* a, int64_t ranks, int64_t j0,
                                   float* acc_out) {
  constexpr int G = kGroup<T>;
  vf acc[M][JV] = {};
  for (int64_t k = 0; k < groups; ++k) {
    vf w[JV][G];
    for (int v = 0; v < JV; ++v) load_group(a + (k * ranks + j0 + kWidth * v) * G, w[v]);
    for (int m = 0; m < M; ++m)
      for (int g = 0; g < G; ++g) {
        const vf xg = broadcast(xw[(m * groups + k) * G + g]);
        for (int v = 0; v < JV; ++v) acc[m][v] = fmadd(xg, w[v][g], acc[m][v]);
      }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < JV; ++v) std::memcpy(acc_out + m * ranks + j0 + kWidth * v, &acc[m][v], sizeof(vf));
}

// y[rows[m]][o + W*v + lane] += sum over rank groups i in [i0, i1) of h[m][G*i ...] . Bt[i][o + ...].
// h: [M][ranks] fp32 (values rounded to T); bt: [ranks/G][out][G].
template <typename T, int M, int OV>
[[gnu::noinline]] void expand_tile(const float* h, int64_t ranks, const T* bt, int64_t out, int64_t i0, int64_t i1,
                                   int64_t o, T* y, const int64_t* rows) {
  constexpr int G = kGroup<T>;
  vf acc[M][OV] = {};
  for (int64_t i = i0; i < i1; ++i) {
    vf w[OV][G];
    for (int v = 0; v < OV; ++v) load_group(bt + (i * out + o + kWidth * v) * G, w[v]);
    for (int m = 0; m < M; ++m)
      for (int g = 0; g < G; ++g) {
        const vf hg = broadcast(h[m * ranks + G * i + g]);
        for (int v = 0; v < OV; ++v) acc[m][v] = fmadd(hg, w[v][g], acc[m][v]);
      }
  }
  for (int m = 0; m < M; ++m) {
    float sums[OV * kWidth];
    std::memcpy(sums, acc[m], sizeof(sums));
    add_row(y + rows[m] * out + o, sums, OV * kWidth);
  }
}

// Rows x[rows[0..M)] of one adapter (`slot`): h = T(T(x @ A[slot].T) * scaling[slot]), then part
// p's columns of y take h's rank block p times Bt[slot]'s rows of that block. Each weight vector
// is loaded once for the M rows; every row's sums run in the same order whatever M is, so a row's
// result does not depend on which rows share its adapter.
template <typename T, int M>
void lora_rows(const T* x, int64_t in, T* y, int64_t out, const LoRAProjection& w, int64_t slot, const int64_t* rows,
               float* acc /* [M][ranks] */, float* xw /* [M][G * groups] */) {
  constexpr int G = kGroup<T>;
  const int64_t groups = w.a.size(1), ranks = w.a.size(2), used = w.scaling.size(1);  // used = P * R
  const T* a = w.a.data_ptr<T>() + slot * groups * ranks * G;
  const T* bt = w.bt.data_ptr<T>() + slot * ranks * out;
  const float* scaling = w.scaling.data_ptr<float>() + slot * used;
  for (int m = 0; m < M; ++m) {  // widened once, not once per rank tile (exact: same products)
    float* row = xw + m * G * groups;
    for (int64_t k = 0; k < in; ++k) row[k] = static_cast<float>(x[rows[m] * in + k]);
    for (int64_t k = in; k < G * groups; ++k) row[k] = 0.0f;
  }
  for (int64_t j0 = 0; j0 < ranks; j0 += kTile * kWidth) {
    if (ranks - j0 >= kTile * kWidth)
      shrink_tile<T, M, kTile>(xw, groups, a, ranks, j0, acc);
    else
      shrink_tile<T, M, 1>(xw, groups, a, ranks, j0, acc);
  }
  float* h = acc;  // in place: h[m][j] = T(T(shrink) * scaling), 0 in the rank padding
  for (int m = 0; m < M; ++m)
    for (int64_t j = 0; j < ranks; ++j) {
      const float shrunk = static_cast<float>(static_cast<T>(acc[m * ranks + j]));
      h[m * ranks + j] = j < used ? static_cast<float>(static_cast<T>(shrunk * scaling[j])) : 0.0f;
    }
  int64_t first = 0;
  for (size_t p = 0; p < w.part_sizes.size(); ++p) {
    const int64_t cols = w.part_sizes[p], r0 = static_cast<int64_t>(p) * w.rank, end = first + cols;
    // the rank groups covering block p; a group straddling two blocks multiplies the other's zeros
    const int64_t i0 = r0 / G, i1 = (r0 + w.rank + G - 1) / G;
    int64_t o = first;
    // whole tiles, then 16-column steps (one or two vectors: the bf16 rounding store's width)
    for (; o + kTile * kWidth <= end; o += kTile * kWidth)
      expand_tile<T, M, kTile>(h, ranks, bt, out, i0, i1, o, y, rows);
    for (; o + kLanes <= end; o += kLanes) expand_tile<T, M, kLanes / kWidth>(h, ranks, bt, out, i0, i1, o, y, rows);
    for (; o < end; ++o)
      for (int m = 0; m < M; ++m) {
        float sum = 0.0f;
        for (int64_t r = G * i0; r < G * i1; ++r)
          sum += h[m * ranks + r] * static_cast<float>(bt[((r / G) * out + o) * G + r % G]);
        T& yo = y[rows[m] * out + o];
        yo = static_cast<T>(static_cast<float>(yo) + sum);
      }
    first = end;
  }
}

template <typename T, int... Ms>
void lora_block(std::integer_sequence<int, Ms...>, const T* x, int64_t in, T* y, int64_t out, const LoRAProjection& w,
                int64_t slot, const int64_t* rows, int m, float* acc, float* xw) {
  ((m == Ms + 1 ? lora_rows<T, Ms + 1>(x, in, y, out, w, slot, rows, acc, xw) : void()), ...);
}

template <typename T>
void add_lora_as(const torch::Tensor& x, torch::Tensor& y, const LoRAProjection& w, const int64_t* row_slots) {
  const int64_t t = x.size(0), in = x.size(1), out = y.size(1), groups = w.a.size(1), ranks = w.a.size(2);
  // the adapter rows grouped by slot (batch order within a slot), in blocks of at most kMaxRows
  std::vector<int64_t> order;
  for (int64_t i = 0; i < t; ++i)
    if (row_slots[i] >= 0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row_slots[a] < row_slots[b]; });
  std::vector<std::pair<int64_t, int>> blocks;  // (first index into order, rows)
  for (size_t i = 0; i < order.size();) {
    size_t end = i + 1;  // this slot's rows: order[i, end)
    while (end < order.size() && row_slots[order[end]] == row_slots[order[i]]) ++end;
    for (size_t j = i; j < end; j += kMaxRows)
      blocks.emplace_back(static_cast<int64_t>(j), static_cast<int>(std::min<size_t>(kMaxRows, end - j)));
    i = end;
  }
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(kMaxRows * ranks), xw(kMaxRows * kGroup<T> * groups);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* rows = order.data() + blocks[b].first;
      lora_block<T>(std::make_integer_sequence<int, kMaxRows>{}, xp, in, yp, out, w, row_slots[rows[0]], rows,
                    blocks[b].second, acc.data(), xw.data());
    }
  });
}

}  // namespace

LoRAProjection lora_projection(torch::Tensor a, torch::Tensor bt, torch::Tensor scaling, std::vector<int64_t> part_sizes,
                               int64_t rank) {
  const auto dtype = a.scalar_type();
  TORCH_CHECK((dtype == torch::kBFloat16 || dtype == torch::kFloat) && bt.scalar_type() == dtype &&
                  scaling.scalar_type() == torch::kFloat && a.is_contiguous() && bt.is_contiguous() &&
                  scaling.is_contiguous() && a.device().is_cpu(),
              "LoRA: bf16 or fp32 A and Bt groups of one dtype, fp32 scaling, contiguous, on the CPU");
  const int64_t parts = static_cast<int64_t>(part_sizes.size()), group = dtype == torch::kFloat ? 1 : 2;
  int64_t out = 0;
  for (int64_t n : part_sizes) out += n;
  TORCH_CHECK(a.dim() == 4 && bt.dim() == 4 && a.size(3) == group && bt.size(3) == group && a.size(0) == bt.size(0) &&
                  a.size(2) % kLanes == 0 && a.size(2) >= parts * rank && bt.size(1) * group == a.size(2) &&
                  bt.size(2) == out && scaling.dim() == 2 && scaling.size(0) == a.size(0) &&
                  scaling.size(1) == parts * rank,
              "LoRA: A groups [slots, in/G, ranks, G], Bt groups [slots, ranks/G, out, G] (G: 2 for bf16, 1 for fp32; "
              "ranks: P*R up to a multiple of 16), scaling [slots, P*R]");
  return LoRAProjection{a, bt, scaling, std::move(part_sizes), rank};
}

void add_lora(const torch::Tensor& x, torch::Tensor& y, const LoRAProjection& w, const int64_t* row_slots) {
  if (!w.a.defined()) return;
  const int64_t in = x.size(1), group = w.a.size(3);
  TORCH_CHECK(x.scalar_type() == w.a.scalar_type() && y.scalar_type() == w.a.scalar_type() && x.is_contiguous() &&
                  y.is_contiguous() && (in + group - 1) / group == w.a.size(1) && y.size(1) == w.bt.size(2),
              "LoRA: x [T, in] and y [T, out] must fit the adapter buffers (and have their dtype)");
  if (x.scalar_type() == torch::kFloat)
    add_lora_as<float>(x, y, w, row_slots);
  else
    add_lora_as<bf16>(x, y, w, row_slots);
}

}  // namespace asyncllm

// engine/lora/ops.py's CPU path (the Python layers): in bf16 the same loops as the fused layer
// loop, so both paths give bit-identical outputs. y is updated in place and returned.
torch::Tensor lora_add_(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor bt, torch::Tensor scaling,
                        std::vector<int64_t> part_sizes, int64_t rank, torch::Tensor row_slots) {
  TORCH_CHECK((x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat) &&
                  y.scalar_type() == x.scalar_type() && x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add_: bf16 or fp32 x [T, in] and y [T, out] of one dtype");
  TORCH_CHECK(row_slots.scalar_type() == torch::kLong && row_slots.is_contiguous() && row_slots.numel() == x.size(0),
              "lora_add_: row_slots int64 [T]");
  const asyncllm::LoRAProjection w = asyncllm::lora_projection(a, bt, scaling, std::move(part_sizes), rank);
  const torch::Tensor xc = x.contiguous();
  asyncllm::add_lora(xc, y, w, row_slots.data_ptr<int64_t>());
  return y;
}
