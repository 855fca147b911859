// Multi-LoRA deltas inside the fused layer loop (cpu_decode_layers.cpp): for each token whose
// request runs an adapter, y[t] += expand(scale * shrink(x[t])) for every part of the projection.
//
// Why here: a forward with adapter rows used to leave the C++ loop for the Python layers, and on
// the default model that cost more than the LoRA arithmetic itself (docs/PERFORMANCE.md, LoRA).
// A decode step's LoRA work is a few hundred small products (rank <= 64), so this runs them as
// plain vector loops, no ATen op per adapter and projection: the rows of one adapter in blocks of
// up to 8, each block reading the adapter's A and Bt once (re-reading them per row cost more than
// the arithmetic), the blocks spread over the threads. Measured on shapes of the default model,
// a prefill's rows ran as fast through these loops as through gathered oneDNN GEMMs (~1 us a row
// per projection either way, 2 cores), so every row count takes them.
//
// The arithmetic and its roundings follow engine/lora/ops.py `add_lora_deltas` (the Python
// layers' path): the shrink x @ A.T accumulated in fp32 and rounded to the model's bf16, times
// the per-rank-column scaling in fp32, rounded to bf16; the expand h @ Bt accumulated in fp32 and
// added to the bf16 output with one rounding. Only the summation order differs from oneDNN's.

#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "decode_layers.h"
#include "vec.h"

namespace asyncllm {

namespace {

using bf16 = c10::BFloat16;

constexpr int kMaxRows = 8;  // rows of one adapter sharing each load of its A and Bt

// Rows x[rows[0..M)] of one adapter (`slot`): h = bf16(bf16(x @ A[slot].T) * scaling[slot]), then
// part p's columns of y take h's rank block p times Bt[slot]'s rows of that block. Each weight
// vector is loaded once for the M rows; every row's sums run in the same order whatever M is, so
// a row's result does not depend on which rows share its adapter.
template <int M>
void lora_rows(const bf16* x, int64_t in, bf16* y, int64_t out, const LoRAProjection& w, int64_t slot,
               const int64_t* rows, float* h /* [M][P*R] */, float* xf /* [M][in] */) {
  const int64_t ranks = w.a.size(1);  // P * R
  const bf16* a = w.a.data_ptr<bf16>() + slot * ranks * in;
  const bf16* bt = w.bt.data_ptr<bf16>() + slot * ranks * out;
  const float* scaling = w.scaling.data_ptr<float>() + slot * ranks;
  const int64_t in_vec = in - in % 16;
  for (int m = 0; m < M; ++m)  // widened once, not once per rank row (exact: same products)
    for (int64_t k = 0; k < in; ++k) xf[m * in + k] = static_cast<float>(x[rows[m] * in + k]);
  for (int64_t j = 0; j < ranks; ++j) {
    const bf16* aj = a + j * in;
    v16f acc[M];
    for (int m = 0; m < M; ++m) acc[m] = splat(0.0f);
    for (int64_t k = 0; k < in_vec; k += 16) {
      const v16f wk = load16(aj + k);
      for (int m = 0; m < M; ++m) acc[m] += load16(xf + m * in + k) * wk;
    }
    for (int m = 0; m < M; ++m) {
      float sum = hsum(acc[m]);
      for (int64_t k = in_vec; k < in; ++k) sum += xf[m * in + k] * static_cast<float>(aj[k]);
      const float shrunk = static_cast<float>(static_cast<bf16>(sum));
      h[m * ranks + j] = static_cast<float>(static_cast<bf16>(shrunk * scaling[j]));
    }
  }
  int64_t first = 0;
  for (size_t p = 0; p < w.part_sizes.size(); ++p) {
    const int64_t cols = w.part_sizes[p], r0 = static_cast<int64_t>(p) * w.rank, end = first + cols;
    int64_t o = first;
    for (; o + 16 <= end; o += 16) {
      v16f acc[M];
      for (int m = 0; m < M; ++m) acc[m] = splat(0.0f);
      for (int64_t r = 0; r < w.rank; ++r) {
        const v16f b = load16(bt + (r0 + r) * out + o);
        for (int m = 0; m < M; ++m) acc[m] += splat(h[m * ranks + r0 + r]) * b;
      }
      for (int m = 0; m < M; ++m) store16(load16(y + rows[m] * out + o) + acc[m], y + rows[m] * out + o);
    }
    for (; o < end; ++o)
      for (int m = 0; m < M; ++m) {
        float acc = 0.0f;
        for (int64_t r = 0; r < w.rank; ++r) acc += h[m * ranks + r0 + r] * static_cast<float>(bt[(r0 + r) * out + o]);
        bf16& yo = y[rows[m] * out + o];
        yo = static_cast<bf16>(static_cast<float>(yo) + acc);
      }
    first = end;
  }
}

void lora_block(const bf16* x, int64_t in, bf16* y, int64_t out, const LoRAProjection& w, int64_t slot,
                const int64_t* rows, int m, float* h, float* xf) {
  switch (m) {
#define LORA_CASE(M) \
  case M: return lora_rows<M>(x, in, y, out, w, slot, rows, h, xf);
    LORA_CASE(1) LORA_CASE(2) LORA_CASE(3) LORA_CASE(4) LORA_CASE(5) LORA_CASE(6) LORA_CASE(7) LORA_CASE(8)
#undef LORA_CASE
  }
}

}  // namespace

LoRAProjection lora_projection(torch::Tensor a, torch::Tensor bt, torch::Tensor scaling, std::vector<int64_t> part_sizes,
                               int64_t rank) {
  TORCH_CHECK(a.scalar_type() == torch::kBFloat16 && bt.scalar_type() == torch::kBFloat16 &&
                  scaling.scalar_type() == torch::kFloat && a.is_contiguous() && bt.is_contiguous() &&
                  scaling.is_contiguous() && a.device().is_cpu(),
              "LoRA: bf16 A and Bt, fp32 scaling, contiguous, on the CPU");
  const int64_t parts = static_cast<int64_t>(part_sizes.size());
  int64_t out = 0;
  for (int64_t n : part_sizes) out += n;
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == parts * rank &&
                  bt.size(1) == parts * rank && bt.size(2) == out && scaling.sizes() == a.sizes().slice(0, 2),
              "LoRA: A [slots, P*R, in], Bt [slots, P*R, out], scaling [slots, P*R]");
  return LoRAProjection{a, bt, scaling, std::move(part_sizes), rank};
}

void add_lora(const torch::Tensor& x, torch::Tensor& y, const LoRAProjection& w, const int64_t* row_slots) {
  if (!w.a.defined()) return;
  const int64_t t = x.size(0), in = x.size(1), out = y.size(1), ranks = w.a.size(1);
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && in == w.a.size(2) && out == w.bt.size(2),
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
    std::vector<float> h(kMaxRows * ranks), xf(kMaxRows * in);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t* rows = order.data() + blocks[b].first;
      lora_block(xp, in, yp, out, w, row_slots[rows[0]], rows, blocks[b].second, h.data(), xf.data());
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
