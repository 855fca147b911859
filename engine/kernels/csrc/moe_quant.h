// A mixture-of-experts layer's experts kept in a GGUF's own blocks (cpu_moe_quant.cpp), for the
// Python layer (engine/layers/moe_quant.py) and the fused decode loop (cpu_decode_layers.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "decode_layers.h"

namespace asyncllm {

class QuantExperts {
 public:
  // Products of more than q4_rows rows per expert run the blocks' dequantized tiles.
  QuantExperts(int64_t hidden, int64_t inter, int64_t q4_rows);
  // The next expert's gate|up [2I, H] and down [H, I] weights: each one quantized form (its
  // tensors, as DecodeLayers::add_layer takes them) or, with no tensors, pieces of different
  // kinds side by side (set_pieces' arguments).
  void add_expert(std::vector<torch::Tensor> w13, std::vector<std::vector<torch::Tensor>> w13_pieces,
                  std::vector<int64_t> w13_widths, std::vector<torch::Tensor> w2,
                  std::vector<std::vector<torch::Tensor>> w2_pieces, std::vector<int64_t> w2_widths);
  int64_t num_experts() const { return static_cast<int64_t>(w13_.size()); }
  // out[t] = sum over token t's (expert, weight) pairs held here of weight * expert(x[t]); x [T, H]
  // bf16 or fp32, ids [T, K] int64 relative to this set's first expert (others skipped), weights
  // [T, K] fp32.
  torch::Tensor forward(torch::Tensor x, torch::Tensor ids, torch::Tensor weights) const;

 private:
  Projection build(const std::vector<torch::Tensor>& parts, const std::vector<std::vector<torch::Tensor>>& pieces,
                   const std::vector<int64_t>& widths, int64_t out_features) const;

  int64_t hidden_, inter_, q4_rows_;
  std::vector<Projection> w13_, w2_;
};

}  // namespace asyncllm
