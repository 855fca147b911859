// A model's decoder layers for a decode batch or a kernel-planned extend, run as one C++ call
// (cpu_decode_layers.cpp).
#pragma once

#include <torch/extension.h>

#include <memory>
#include <optional>
#include <vector>

namespace asyncllm {

// One projection: its quantized form (cpu_quant_gemv.cpp's tiled 4-bit layout, fp16 or K-form
// scales; Q8_0 blocks when `q8`, Q6_K's or Q5_K's when `q8` with offsets, their per-256 d's) for inputs of at most q4_rows rows, its dense weight for more: bf16 prepacked for
// oneDNN (engine/layers/linear.py OneDNNLinear) or resident in VNNI pairs [N/64, K/2, 64, 2] (VnniLinear,
// cpu_vnni_linear.cpp: every row count, no row tiles), or fp32 as it is (DenseLinear: 1..small_rows
// rows through cpu_gemv.cpp's loop, more through at::linear). Either may be missing (undefined
// tensors): a dense-only model has q4_rows 0; a projection with no dense form runs more than
// q4_rows rows through its blocks' dequantized tiles (cpu_quant_tiles.cpp).
struct Projection {
  torch::Tensor codes, scales, offsets;  // offsets: 4-bit, or Q6_K's / Q5_K's d's
  bool q8 = false;
  torch::Tensor dense;
  torch::Tensor bias;  // undefined: none (Qwen2 has q|k|v biases)
  int64_t out_features;
  int64_t q4_rows;
  int64_t small_rows = 0;  // fp32 dense: inputs of 1..small_rows rows take gemv_f32
  // deterministic inference: the dense weight runs on whole tiles of this many rows, the last
  // zero-padded (engine/layers/linear.py BatchInvariantLinear; fp32: gemv_f32 on groups of this
  // many rows, cpu_gemv.gemv_groups); 0: one call over every row
  int64_t tile_rows = 0;
  // a fused projection whose parts came in blocks of different kinds (llama.cpp's Q4_K_M: Q4_K q
  // and k beside a Q6_K v): each part's quantized form, outputs side by side, in place of `codes`
  // for inputs of at most q4_rows rows (engine/layers/linear.py QuantParts)
  std::vector<Projection> pieces;
};

// A projection of quantized tensors only (as add_layer takes them; none: its pieces come by
// set_projection_pieces), no bias: rows above q4_rows run the blocks' dequantized tiles.
Projection make_projection(const std::vector<torch::Tensor>& parts, int64_t out_features, int64_t q4_rows);
// `p`'s parts in blocks of different kinds, run side by side (DecodeLayers::set_pieces).
void set_projection_pieces(Projection& p, const std::vector<std::vector<torch::Tensor>>& pieces,
                           const std::vector<int64_t>& piece_out, int64_t q4_rows);
// y = x @ W.T (+ bias) through the form QuantLinear (or the dense layer) runs for x's row count.
torch::Tensor project_rows(const torch::Tensor& x, const Projection& w);
// mkldnn::_linear_pointwise on a prepacked weight (and its bias, undefined: none) with no fused
// op: the call OneDNNLinear.forward makes, through the dispatcher, so both paths run one kernel.
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias);
// A MoE router's logits x @ gate.T (cpu_moe_router.cpp): a few bf16 rows through its own loop,
// more through `packed` (oneDNN's form of gate); without one, at::linear.
torch::Tensor moe_router_logits(const torch::Tensor& x, const torch::Tensor& gate,
                                const std::optional<torch::Tensor>& packed);

// One projection's multi-LoRA buffers (engine/lora/pool.py LoRAWeights, the C++ path's form):
// A as bf16 pairs [slots, in/2, ranks, 2] and the block-diagonal Bt as [slots, ranks/2, out, 2]
// (part p's columns take rank block p only; ranks = P*R rounded up to 16, zeros in the padding),
// the scaling [slots, P*R] fp32; undefined a: the projection has none.
struct LoRAProjection {
  torch::Tensor a, bt, scaling;
  std::vector<int64_t> part_sizes;  // output columns of each part (q/k/v, gate/up, or one)
  int64_t rank = 0;                 // R, the rank block of one part
};

class QuantExperts;  // moe_quant.h

struct DecodeLayer {
  torch::Tensor input_norm, post_norm;
  torch::Tensor qk_norm;  // Qwen3's [H + KVH, D] table of q and k norm weights; undefined: none
  Projection qkv, o, gate_up, down;
  torch::Tensor k_buffer, v_buffer;  // this layer's KV pool [S, KVH, D]
  LoRAProjection lora[4];            // q|k|v, o, gate|up, down
  // A mixture-of-experts MLP in place of gate|up and down (engine/layers/moe.py FusedMoE): the
  // router's weight [E, H] and FusedMoE.route's options; its experts in blocks (`experts`), or
  // dense bf16/fp32 stacks w13 [E, 2I, H] and w2 [E, H, I] for cpu_moe.cpp's one-call kernel;
  // neither: a dense MLP.
  std::shared_ptr<const QuantExperts> experts;
  torch::Tensor experts_w13, experts_w2;
  torch::Tensor router;         // [E, H], FusedMoE.gate
  torch::Tensor router_packed;  // oneDNN's form of it (FusedMoE.router_packed); undefined: none
  int64_t top_k = 0;
  bool renormalize = false, fp32_weights = false;
};

// A LoRAProjection over the pool's buffers, their dtypes and shapes checked.
LoRAProjection lora_projection(torch::Tensor a, torch::Tensor bt, torch::Tensor scaling, std::vector<int64_t> part_sizes,
                               int64_t rank);

// y[t] += the LoRA delta of token t's adapter (row_slots[t]; -1: none) for projection `w`
// (cpu_lora.cpp); a projection without LoRA buffers is left alone.
void add_lora(const torch::Tensor& x, torch::Tensor& y, const LoRAProjection& w, const int64_t* row_slots);

// The fp32 loop's elementwise steps with the Python layers' torch roundings (cpu_decode_f32_ops.cpp):
// norm.py rms_norm of contiguous [T, N] rows, rotary.py apply_rotary of [T, NH, D] heads (a new
// contiguous tensor), and KVCache.set_kv's copy of [T, KVH, D] rows to buffer[loc] (any dtype).
torch::Tensor f32_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor f32_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
void store_rows(const torch::Tensor& buffer, const torch::Tensor& loc, const torch::Tensor& rows);

class DecodeLayers {
 public:
  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scaling);
  // Each projection's parts: (codes uint8, scales, offsets) for a 4-bit form, (codes int8,
  // scales) for a Q8_0 one, (codes int8, scales int8, d) for a Q6_K one or (codes int8, sc|m
  // uint8, d|dmin) for a Q5_K one, then the prepacked dense weight if it has one (so 1, 2, 3 or 4
  // tensors); q4_rows: each projection's bound on its quantized form's inputs (a Q4_K_M file's
  // Q4_K and Q6_K tensors have their own, as their modules do).
  // biases: one per projection (q|k|v, o, gate|up, down), None where it has none; qk_norm: the
  // layer's q/k norm table, or None; tile_rows: every dense projection's row tile (0: none);
  // small_rows: an fp32 dense weight's row bound for gemv_f32 (DenseLinear.small_rows).
  void add_layer(torch::Tensor input_norm, std::vector<torch::Tensor> qkv, int64_t qkv_out, std::vector<torch::Tensor> o,
                 int64_t o_out, torch::Tensor post_norm, std::vector<torch::Tensor> gate_up, int64_t gate_up_out,
                 std::vector<torch::Tensor> down, int64_t down_out, torch::Tensor k_buffer, torch::Tensor v_buffer,
                 std::vector<int64_t> q4_rows, std::vector<std::optional<torch::Tensor>> biases,
                 std::optional<torch::Tensor> qk_norm, int64_t tile_rows, int64_t small_rows);
  // x: the residual stream [T, hidden], bf16 (updated in place and returned) or fp32 (a new
  // tensor: fp32 runs the Python layers' torch ops for the elementwise steps); cos/sin [T, D];
  // out_cache_loc [T] int64 (where each token's K/V go); slots [R, L] int64 (each request's
  // slot row). Decode (one token per request): lens [R] the requests' lengths, no prefix_lens.
  // Extend: lens [R] the new tokens per request, prefix_lens [R]. Grouped decode (a speculative
  // verify, attention_cpu.per_token_decode_plan): lens [T] per token, query_starts [R + 1].
  // lora_slots: each token's LoRA pool slot [T] int64 (-1: the base model), None: no LoRA rows.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor out_cache_loc,
                        torch::Tensor slots, torch::Tensor lens, std::optional<torch::Tensor> prefix_lens,
                        std::optional<torch::Tensor> query_starts, std::optional<torch::Tensor> lora_slots) const;
  // `projection` (0 q|k|v, 1 o, 2 gate|up, 3 down) of `layer` runs `pieces` (each one part's
  // quantized tensors, as add_layer takes them, its outputs `piece_out` wide) side by side for
  // inputs of at most q4_rows rows, its dense weight above (none: the pieces' dequantized tiles).
  void set_pieces(int64_t layer, int64_t projection, std::vector<std::vector<torch::Tensor>> pieces,
                  std::vector<int64_t> piece_out, int64_t q4_rows);
  // The LoRA pool's buffers of `projection` (0 q|k|v, 1 o, 2 gate|up, 3 down) in `layer`, kept by
  // reference: the pool writes its slots in place between forwards.
  void set_lora(int64_t layer, int64_t projection, torch::Tensor a, torch::Tensor bt, torch::Tensor scaling,
                std::vector<int64_t> part_sizes, int64_t rank);
  // `layer`'s MLP is a mixture of experts (added with empty gate|up and down): the router's
  // weight and (or None) its oneDNN-prepacked form, the experts in blocks or (None) the dense
  // stacks w13 and w2, FusedMoE.route's top_k, renormalize and fp32_weights.
  void set_moe(int64_t layer, torch::Tensor router, std::optional<torch::Tensor> router_packed,
               std::shared_ptr<QuantExperts> experts,
               std::optional<torch::Tensor> w13, std::optional<torch::Tensor> w2, int64_t top_k, bool renormalize,
               bool fp32_weights);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scaling_;
  std::vector<DecodeLayer> layers_;
};

}  // namespace asyncllm
