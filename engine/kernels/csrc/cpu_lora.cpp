// Multi-LoRA deltas inside the fused layer loop (cpu_decode_layers.cpp): for each token whose
// request runs an adapter, y[t] += expand(scale * shrink(x[t])) for every part of the projection.
//
// Why here: a forward with adapter rows used to leave the C++ loop for the Python layers, and on
// the default model that cost more than the LoRA arithmetic itself (docs/PERFORMANCE.md, LoRA).
// A decode step's LoRA work is a few hundred small products (rank <= 64), so this runs them as
// plain vector loops, no ATen op per adapter and projection: the rows of one adapter in blocks,
// each block reading the adapter's A and Bt once (re-reading them per row cost more than the
// arithmetic), the blocks spread over the threads. Measured on shapes of the default model, a
// prefill's rows ran as fast through these loops as through gathered oneDNN GEMMs, so every row
// count takes them.
//
// Layout (engine/lora/pool.py `pack_pairs` writes it): the weights are stored as bf16 pairs along
// the dimension each product sums over, A as [slots, in/2, ranks, 2] and Bt as
// [slots, ranks/2, out, 2], so one 64-byte load holds two summed-over elements for 16 outputs:
// the shrink's 16 rank outputs sit in one vector's lanes (no horizontal sums), the expand's in 16
// output columns, and each input value is broadcast once per 16 outputs. `ranks` is P*R rounded
// up to 16; its padding holds zeros.
//
// The arithmetic and its roundings follow engine/lora/ops.py `add_lora_deltas` (the Python
// layers' path): the shrink x @ A.T accumulated in fp32 and rounded to the model's bf16, times
// the per-rank-column scaling in fp32, rounded to bf16; the expand h @ Bt accumulated in fp32 and
// added to the bf16 output with one rounding. bf16 products are exact in fp32, so only the
// summation order differs from oneDNN's.

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
using native::kWidth;
using native::vf;
using native::vu;
#if defined(__AVX512F__)
constexpr int kMaxRows = 8, kTile = 2;
#else
constexpr int kMaxRows = 4, kTile = 2;
#endif
constexpr int kLanes = 16;  // the pool pads the ranks to a multiple of this (>= kWidth)

// kWidth bf16 pairs widened to fp32: lo holds each pair's first element, hi its second.
struct Pairs {
  vf lo, hi;
};

inline Pairs load_pairs(const bf16* w) {
  vu u;
  std::memcpy(&u, w, sizeof(u));
  const vu lo = u << 16, hi = u & 0xffff0000u;  // bf16 is the top half of an fp32
  Pairs out;
  std::memcpy(&out.lo, &lo, sizeof(lo));
  std::memcpy(&out.hi, &hi, sizeof(hi));
  return out;
}

// acc[m][j0 + W*v + lane] = sum over k of x[m][k] * A[k][j0 + W*v + lane], JV vectors of ranks.
// xw: each row widened to fp32, 2 * pairs values (an odd `in` padded with 0); a: [pairs][ranks][2].
template <int M, int JV>
void shrink_tile(const float* xw, int64_t pairs, const bf16* a, int64_t ranks, int64_t j0, float* acc_out) {
  vf acc[M][JV] = {};
  for (int64_t k = 0; k < pairs; ++k) {
    Pairs w[JV];
    for (int v = 0; v < JV; ++v) w[v] = load_pairs(a + (k * ranks + j0 + kWidth * v) * 2);
    for (int m = 0; m < M; ++m) {
      const vf x0 = broadcast(xw[(m * pairs + k) * 2]), x1 = broadcast(xw[(m * pairs + k) * 2 + 1]);
      for (int v = 0; v < JV; ++v) acc[m][v] = acc[m][v] + x0 * w[v].lo + x1 * w[v].hi;  // two FMAs
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < JV; ++v) std::memcpy(acc_out + m * ranks + j0 + kWidth * v, &acc[m][v], sizeof(vf));
}

// y[rows[m]][o + W*v + lane] += sum over rank pairs i in [i0, i1) of h[m][2i, 2i+1] . Bt[i][o + ...].
// h: [M][ranks] fp32 (bf16-rounded values); bt: [ranks/2][out][2].
template <int M, int OV>
void expand_tile(const float* h, int64_t ranks, const bf16* bt, int64_t out, int64_t i0, int64_t i1, int64_t o, bf16* y,
                 const int64_t* rows) {
  vf acc[M][OV] = {};
  for (int64_t i = i0; i < i1; ++i) {
    Pairs w[OV];
    for (int v = 0; v < OV; ++v) w[v] = load_pairs(bt + (i * out + o + kWidth * v) * 2);
    for (int m = 0; m < M; ++m) {
      const vf h0 = broadcast(h[m * ranks + 2 * i]), h1 = broadcast(h[m * ranks + 2 * i + 1]);
      for (int v = 0; v < OV; ++v) acc[m][v] = acc[m][v] + h0 * w[v].lo + h1 * w[v].hi;
    }
  }
  // y += acc, 16 columns at a time through vec.h's bf16 load and rounding store
  for (int m = 0; m < M; ++m) {
    float sums[OV * kWidth];
    std::memcpy(sums, acc[m], sizeof(sums));
    bf16* yo = y + rows[m] * out + o;
    for (int c = 0; c < OV * kWidth; c += kLanes) store16(load16(yo + c) + load16(sums + c), yo + c);
  }
}

// Rows x[rows[0..M)] of one adapter (`slot`): h = bf16(bf16(x @ A[slot].T) * scaling[slot]), then
// part p's columns of y take h's rank block p times Bt[slot]'s rows of that block. Each weight
// vector is loaded once for the M rows; every row's sums run in the same order whatever M is, so
// a row's result does not depend on which rows share its adapter.
template <int M>
void lora_rows(const bf16* x, int64_t in, bf16* y, int64_t out, const LoRAProjection& w, int64_t slot,
               const int64_t* rows, float* acc /* [M][ranks] */, float* xw /* [M][2 * pairs] */) {
  const int64_t pairs = w.a.size(1), ranks = w.a.size(2), used = w.scaling.size(1);  // used = P * R
  const bf16* a = w.a.data_ptr<bf16>() + slot * pairs * ranks * 2;
  const bf16* bt = w.bt.data_ptr<bf16>() + slot * ranks * out;
  const float* scaling = w.scaling.data_ptr<float>() + slot * used;
  for (int m = 0; m < M; ++m) {  // widened once, not once per rank tile (exact: same products)
    float* row = xw + m * 2 * pairs;
    for (int64_t k = 0; k < in; ++k) row[k] = static_cast<float>(x[rows[m] * in + k]);
    if (in % 2) row[in] = 0.0f;
  }
  for (int64_t j0 = 0; j0 < ranks; j0 += kTile * kWidth) {
    if (ranks - j0 >= kTile * kWidth)
      shrink_tile<M, kTile>(xw, pairs, a, ranks, j0, acc);
    else
      shrink_tile<M, 1>(xw, pairs, a, ranks, j0, acc);
  }
  float* h = acc;  // in place: h[m][j] = bf16(bf16(shrink) * scaling), 0 in the rank padding
  for (int m = 0; m < M; ++m)
    for (int64_t j = 0; j < ranks; ++j) {
      const float shrunk = static_cast<float>(static_cast<bf16>(acc[m * ranks + j]));
      h[m * ranks + j] = j < used ? static_cast<float>(static_cast<bf16>(shrunk * scaling[j])) : 0.0f;
    }
  int64_t first = 0;
  for (size_t p = 0; p < w.part_sizes.size(); ++p) {
    const int64_t cols = w.part_sizes[p], r0 = static_cast<int64_t>(p) * w.rank, end = first + cols;
    // the rank pairs covering block p; a pair straddling two blocks multiplies the other's zeros
    const int64_t i0 = r0 / 2, i1 = (r0 + w.rank + 1) / 2;
    int64_t o = first;
    // whole tiles, then 16-column steps (one or two vectors: the rounding store's width)
    for (; o + kTile * kWidth <= end; o += kTile * kWidth) expand_tile<M, kTile>(h, ranks, bt, out, i0, i1, o, y, rows);
    for (; o + kLanes <= end; o += kLanes) expand_tile<M, kLanes / kWidth>(h, ranks, bt, out, i0, i1, o, y, rows);
    for (; o < end; ++o)
      for (int m = 0; m < M; ++m) {
        float sum = 0.0f;
        for (int64_t r = 2 * i0; r < 2 * i1; ++r)
          sum += h[m * ranks + r] * static_cast<float>(bt[((r / 2) * out + o) * 2 + r % 2]);
        bf16& yo = y[rows[m] * out + o];
        yo = static_cast<bf16>(static_cast<float>(yo) + sum);
      }
    first = end;
  }
}

template <int... Ms>
void lora_block(std::integer_sequence<int, Ms...>, const bf16* x, int64_t in, bf16* y, int64_t out,
                const LoRAProjection& w, int64_t slot, const int64_t* rows, int m, float* acc, float* xw) {
  ((m == Ms + 1 ? lora_rows<Ms + 1>(x, in, y, out, w, slot, rows, acc, xw) : void()), ...);
}

}  // namespace

LoRAProjection lora_projection(torch::Tensor a, torch::Tensor bt, torch::Tensor scaling, std::vector<int64_t> part_sizes,
                               int64_t rank) {
  TORCH_CHECK(a.scalar_type() == torch::kBFloat16 && bt.scalar_type() == torch::kBFloat16 &&
                  scaling.scalar_type() == torch::kFloat && a.is_contiguous() && bt.is_contiguous() &&
                  scaling.is_contiguous() && a.device().is_cpu(),
              "LoRA: bf16 A and Bt pairs, fp32 scaling, contiguous, on the CPU");
  const int64_t parts = static_cast<int64_t>(part_sizes.size());
  int64_t out = 0;
  for (int64_t n : part_sizes) out += n;
  TORCH_CHECK(a.dim() == 4 && bt.dim() == 4 && a.size(3) == 2 && bt.size(3) == 2 && a.size(0) == bt.size(0) &&
                  a.size(2) % kLanes == 0 && a.size(2) >= parts * rank && bt.size(1) * 2 == a.size(2) &&
                  bt.size(2) == out && scaling.dim() == 2 && scaling.size(0) == a.size(0) &&
                  scaling.size(1) == parts * rank,
              "LoRA: A pairs [slots, in/2, ranks, 2], Bt pairs [slots, ranks/2, out, 2] (ranks: P*R up to a "
              "multiple of 16), scaling [slots, P*R]");
  return LoRAProjection{a, bt, scaling, std::move(part_sizes), rank};
}

void add_lora(const torch::Tensor& x, torch::Tensor& y, const LoRAProjection& w, const int64_t* row_slots) {
  if (!w.a.defined()) return;
  const int64_t t = x.size(0), in = x.size(1), out = y.size(1), pairs = w.a.size(1), ranks = w.a.size(2);
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && (in + 1) / 2 == pairs && out == w.bt.size(2),
              "LoRA: x [T, in] and y [T, out] must fit the adapter buffers");
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
  const bf16* xp = x.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(kMaxRows * ranks), xw(kMaxRows * 2 * pairs);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* rows = order.data() + blocks[b].first;
      lora_block(std::make_integer_sequence<int, kMaxRows>{}, xp, in, yp, out, w, row_slots[rows[0]], rows,
                 blocks[b].second, acc.data(), xw.data());
    }
  });
}

}  // namespace asyncllm

// engine/lora/ops.py's CPU bf16 path (the Python layers): the same loops as the fused layer loop,
// so both paths give bit-identical outputs. y is updated in place and returned.
torch::Tensor lora_add_(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor bt, torch::Tensor scaling,
                        std::vector<int64_t> part_sizes, int64_t rank, torch::Tensor row_slots) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && y.scalar_type() == torch::kBFloat16 && x.dim() == 2 &&
                  y.dim() == 2 && x.size(0) == y.size(0),
              "lora_add_: bf16 x [T, in] and y [T, out]");
  TORCH_CHECK(row_slots.scalar_type() == torch::kLong && row_slots.is_contiguous() && row_slots.numel() == x.size(0),
              "lora_add_: row_slots int64 [T]");
  const asyncllm::LoRAProjection w = asyncllm::lora_projection(a, bt, scaling, std::move(part_sizes), rank);
  const torch::Tensor xc = x.contiguous();
  asyncllm::add_lora(xc, y, w, row_slots.data_ptr<int64_t>());
  return y;
}
