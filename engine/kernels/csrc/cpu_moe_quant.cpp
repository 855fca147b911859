// A mixture-of-experts layer's experts kept in a GGUF's own blocks, any kind the dense projections
// run (engine/layers/moe_quant.py): Q4_0/Q4_1/Q4_K tiles, Q8_0, and Q6_K/Q5_K (lane order for a
// bf16 x), a gate|up whose halves came in different kinds side by side; bf16 or fp32 x.
//
// Why: a decode step of a MoE model reads its routed experts' weights, and in bf16 those are
// 3.5x a Q4_K file's bytes; a Q4_K_M MoE file ran its experts from the dense bf16 copy at ~0.45x
// llama.cpp's single-stream speed (docs/PERFORMANCE.md). Each expert here is a `Projection` pair
// (decode_layers.h) and runs exactly what a dense QuantLinear runs for its rows: the small-batch
// block loops up to the model's measured row bound, the blocks' dequantized tiles above it. So
// the experts need no dense copy and no kernel of their own per block kind.
//
// How: the (token, choice) pairs are grouped by expert; one parallel region takes the active
// experts, each thread running an expert's gate|up product, SiLU-and-mul and down product inline
// (the projections' own parallel loops run serially inside a region), so a decode step with its
// eight experts pays one fork instead of sixteen. A lone active expert runs on the caller's thread
// with its projections' loops parallel. The weighted sum then runs in ascending expert order.
//
// Roundings as FusedMoE.experts (the torch path): each product's output in x's dtype, SiLU-and-mul
// as the model's activation (the bf16 kernel, or torch's ops in fp32), y * weight rounded to x's
// dtype, then added to the token's output with one rounding per add, experts ascending.

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <vector>

#include "moe_quant.h"

torch::Tensor silu_mul(torch::Tensor gate_up);

namespace asyncllm {

namespace {

template <typename T>
void add_weighted(const torch::Tensor& y, const std::vector<int64_t>& pairs, const float* weights, int64_t top_k,
                  torch::Tensor& out) {
  const int64_t hidden = out.size(1);
  const T* yp = y.data_ptr<T>();
  T* op = out.data_ptr<T>();
  for (size_t i = 0; i < pairs.size(); ++i) {
    const float w = weights[pairs[i]];
    T* o = op + pairs[i] / top_k * hidden;
    const T* row = yp + static_cast<int64_t>(i) * hidden;
    for (int64_t c = 0; c < hidden; ++c) {
      const T scaled = static_cast<T>(static_cast<float>(row[c]) * w);
      o[c] = static_cast<T>(static_cast<float>(o[c]) + static_cast<float>(scaled));
    }
  }
}

}  // namespace

QuantExperts::QuantExperts(int64_t hidden, int64_t inter, int64_t q4_rows)
    : hidden_(hidden), inter_(inter), q4_rows_(q4_rows) {
  TORCH_CHECK(hidden > 0 && inter > 0 && q4_rows >= 0, "QuantExperts: sizes");
}

void QuantExperts::add_expert(std::vector<torch::Tensor> w13, std::vector<std::vector<torch::Tensor>> w13_pieces,
                              std::vector<int64_t> w13_widths, std::vector<torch::Tensor> w2,
                              std::vector<std::vector<torch::Tensor>> w2_pieces, std::vector<int64_t> w2_widths) {
  w13_.push_back(build(w13, w13_pieces, w13_widths, 2 * inter_));
  w2_.push_back(build(w2, w2_pieces, w2_widths, hidden_));
}

torch::Tensor QuantExperts::forward(torch::Tensor x, torch::Tensor ids, torch::Tensor weights) const {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == hidden_ &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat),
              "QuantExperts: x bf16 or fp32 [T, hidden] on the CPU");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && weights.scalar_type() == torch::kFloat &&
                  ids.sizes() == weights.sizes() && ids.dim() == 2 && ids.size(0) == x.size(0),
              "QuantExperts: ids int64 and weights fp32, [T, K] each");
  const torch::Tensor xc = x.contiguous(), idc = ids.contiguous(), wc = weights.contiguous();
  const int64_t top_k = idc.size(1), experts = num_experts();
  const int64_t* id = idc.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> pairs(experts);  // each expert's (token, choice) pairs, ascending
  for (int64_t p = 0; p < idc.numel(); ++p)
    if (id[p] >= 0 && id[p] < experts) pairs[id[p]].push_back(p);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (!pairs[e].empty()) active.push_back(e);

  const bool f32 = xc.scalar_type() == torch::kFloat;
  std::vector<torch::Tensor> ys(experts);
  auto run = [&](int64_t e) {
    const int64_t n = static_cast<int64_t>(pairs[e].size()), first = pairs[e][0] / top_k;
    std::vector<int64_t> tokens(n);
    bool consecutive = true;  // a decode row's expert, or a run of tokens: a view of x, no gather
    for (int64_t i = 0; i < n; ++i) {
      tokens[i] = pairs[e][i] / top_k;
      consecutive = consecutive && tokens[i] == first + i;
    }
    const torch::Tensor rows = consecutive
                                   ? xc.narrow(0, first, n)
                                   : xc.index_select(0, torch::from_blob(tokens.data(), {n}, torch::kLong));
    const torch::Tensor gate_up = project_rows(rows, w13_[e]);
    const torch::Tensor h = f32 ? torch::silu(gate_up.narrow(1, 0, inter_)) * gate_up.narrow(1, inter_, inter_)
                                : silu_mul(gate_up);
    ys[e] = project_rows(h.contiguous(), w2_[e]).contiguous();
  };
  const int64_t n = static_cast<int64_t>(active.size());
  const bool inference = c10::InferenceMode::is_enabled();  // the outputs may be inference tensors
  at::parallel_for(0, n, 1, [&](int64_t a, int64_t b) {
    const c10::InferenceMode same_mode(inference);  // OpenMP's workers do not inherit the caller's
    for (int64_t i = a; i < b; ++i) run(active[i]);
  });

  torch::Tensor out = torch::zeros_like(xc);
  const float* wt = wc.data_ptr<float>();
  for (const int64_t e : active) {
    if (f32)
      add_weighted<float>(ys[e], pairs[e], wt, top_k, out);
    else
      add_weighted<c10::BFloat16>(ys[e], pairs[e], wt, top_k, out);
  }
  return out;
}

Projection QuantExperts::build(const std::vector<torch::Tensor>& parts,
                               const std::vector<std::vector<torch::Tensor>>& pieces, const std::vector<int64_t>& widths,
                               int64_t out_features) const {
  TORCH_CHECK(parts.empty() != pieces.empty(), "QuantExperts: a quantized form or its pieces, not both");
  TORCH_CHECK(parts.empty() || parts.size() == 2 || parts.size() == 3, "QuantExperts: quantized tensors only");
  Projection p = make_projection(parts, out_features, q4_rows_);
  if (!pieces.empty()) set_projection_pieces(p, pieces, widths, q4_rows_);
  return p;
}

}  // namespace asyncllm

void bind_quant_experts(pybind11::module& m) {
  pybind11::class_<asyncllm::QuantExperts, std::shared_ptr<asyncllm::QuantExperts>>(m, "QuantExperts")
      .def(pybind11::init<int64_t, int64_t, int64_t>())
      .def("add_expert", &asyncllm::QuantExperts::add_expert)
      .def("num_experts", &asyncllm::QuantExperts::num_experts)
      .def("forward", &asyncllm::QuantExperts::forward, "a MoE layer's quantized experts (engine/layers/moe_quant.py)",
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
