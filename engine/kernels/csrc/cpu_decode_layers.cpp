// Every decoder layer of a decode batch (or an extend the attention kernels plan, such as a
// speculative verify) in one C++ call (engine/layers/fused_decode.py).
//
// Why: after the 4-bit GEMVs (cpu_quant_gemv.cpp) made a bs-1 step's weight reads cheap, the
// Python between the ops was a third of the step: ~14 calls per layer, each an interpreter
// dispatch, a pybind crossing and tensor wrapping, on the one core the forward has. This runs the
// same C++ kernels in the same order with the same arguments as the Python layers do (RMSNorm,
// q|k|v projection, rotary, K/V store, paged decode attention, o projection, residual add +
// RMSNorm, gate|up projection, SiLU-and-mul, down projection, residual add; the extend attention
// kernel for an extend), so its results are bit-identical to them, and it runs with the GIL
// released: the event loop's thread gets the interpreter for the whole step. Larger batches take
// each projection's prepacked oneDNN weight, as QuantLinear/OneDNNLinear do above their 4-bit row
// bound: there the Python was still ~2-3 ms a step, and a 2-core forward's second thread spun
// through it.
//
// fp32 (the transformers parity path, and the default dtype on CPUs without bf16 arithmetic):
// the same loop, where each elementwise step rounds as the torch ops the Python layers run
// (RMSNorm as transformers computes it and rotary as x*cos + swapped*sin in plain loops with
// torch's roundings, cpu_decode_f32_ops.cpp; silu(gate)*up, the residual adds and Qwen3's q/k
// norm as those torch ops), so its bits are the Python layers' and greedy output stays
// transformers'; each projection runs the form its Python module would for that row count (the
// fp32 block-quantized loops, gemv_f32 for a few dense rows, at::linear above). On a 2-core AVX2
// CPU the ~1,500 Python-level op calls of an fp32 decode step of the default model were half its
// time.
//
// Scope (checked on the Python side): Llama-style layers (projection biases as Qwen2 has them, the
// q/k norm of Qwen3), SiLU, bf16 with every projection 4-bit and/or dense (prepacked for oneDNN, or
// in VNNI pairs) and the fused elementwise kernels, or fp32 with the torch forms (full rotary), the
// kernel attention plans, one rank; multi-LoRA deltas after each projection where the forward has adapter rows
// (cpu_lora.cpp, which the Python layers call too); a mixture-of-experts MLP whose experts run in
// blocks (FusedMoE.route's torch ops, then cpu_moe_quant.cpp's experts, as the Python layer) or
// dense through cpu_moe.cpp's one-call kernel (forwards within its bound only).

#include "decode_layers.h"
#include "moe_quant.h"

#include <limits>

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor rms_norm_heads(torch::Tensor x, torch::Tensor table, double eps, bool unit_offset);
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                            torch::Tensor slots, torch::Tensor lens, double scale,
                                            std::optional<torch::Tensor> query_starts, double softcap);
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens, double scale, double softcap,
                               int64_t window);
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                      int64_t n_out, bool vectorized);
torch::Tensor q8_blocks_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                             std::optional<torch::Tensor> supers, bool vectorized);
torch::Tensor q4_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out, bool vectorized);
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
torch::Tensor q4_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out);
torch::Tensor q8_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          std::optional<torch::Tensor> supers);
torch::Tensor vnni_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t n_out);
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor ids,
                          torch::Tensor weights);

namespace asyncllm {

// See decode_layers.h.
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  c10::List<std::optional<at::Scalar>> scalars;
  scalars.push_back(std::nullopt);
  torch::jit::Stack stack{x, packed, bias.defined() ? c10::IValue(bias) : c10::IValue(), std::string("none"), scalars,
                          std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

namespace {

Projection projection(const std::vector<torch::Tensor>& parts, int64_t out_features, int64_t q4_rows,
                      const std::optional<torch::Tensor>& bias, int64_t tile_rows, int64_t small_rows) {
  const bool q8 = parts.size() > 1 && parts[0].dim() == 2;  // 8-bit codes are [N, K], 4-bit tiles 4-D
  // Q6_K (int8 scales) and Q5_K (uint8 sc and m) have a third tensor, their d's
  const bool q6 = q8 && (parts[1].scalar_type() == torch::kChar || parts[1].scalar_type() == torch::kByte);
  const size_t quant = q8 && !q6 ? 2 : 3;  // tensors of the quantized form
  // none: a fused projection whose parts' blocks come by set_pieces, with no dense weight
  TORCH_CHECK(parts.size() <= 1 || parts.size() == quant || parts.size() == quant + 1,
              "a projection is (codes, scales[, offsets]), its dense weight, both, or (pieces to come) none");
  Projection p{};
  p.out_features = out_features;
  p.q4_rows = parts.size() == 1 ? 0 : q4_rows;
  p.q8 = q8;
  if (parts.size() >= quant) {
    p.codes = parts[0];
    p.scales = parts[1];
    if (quant == 3) p.offsets = parts[2];
  }
  if (!parts.empty() && parts.size() != quant) p.dense = parts.back();
  if (bias.has_value()) p.bias = *bias;
  p.tile_rows = tile_rows;
  p.small_rows = small_rows;
  TORCH_CHECK(tile_rows == 0 || p.dense.defined(), "row tiles take a dense weight");
  return p;
}

// BatchInvariantLinear.forward (deterministic inference): the dense weight on whole tiles of
// `tile_rows` rows, the last one zero-padded, so a row's result does not depend on the batch.
torch::Tensor tiled_dense(const torch::Tensor& x, const Projection& w) {
  const int64_t t = x.size(0), rows = w.tile_rows;
  if (t == rows) return dense_linear(x, w.dense, w.bias);
  const int64_t pad = (rows - t % rows) % rows;
  const torch::Tensor padded = pad ? torch::cat({x, x.new_zeros({pad, x.size(1)})}) : x;
  torch::Tensor out = padded.new_empty({t + pad, w.out_features});
  for (int64_t start = 0; start < t + pad; start += rows)
    out.narrow(0, start, rows).copy_(dense_linear(padded.narrow(0, start, rows), w.dense, w.bias));
  return out.narrow(0, 0, t);
}

std::optional<torch::Tensor> optional(const torch::Tensor& t) {
  return t.defined() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

// cpu_gemv.gemv_groups (fp32 deterministic inference): gemv_f32 on `tile_rows` rows at a time,
// so each row's result is the same bits as alone.
torch::Tensor grouped_gemv_f32(const torch::Tensor& x, const Projection& w) {
  const int64_t t = x.size(0), rows = w.tile_rows;
  if (t <= rows) return gemv_f32(x, w.dense, optional(w.bias));
  std::vector<torch::Tensor> parts;
  for (int64_t start = 0; start < t; start += rows)
    parts.push_back(gemv_f32(x.narrow(0, start, std::min(rows, t - start)), w.dense, optional(w.bias)));
  return torch::cat(parts);
}

// QuantLinear.forward: the quantized GEMV then `out + bias` up to the row bound, else the dense
// form (DenseLinear.forward for an fp32 weight, OneDNNLinear.forward for a prepacked bf16 one), or
// with no dense copy the blocks' dequantized tiles (DequantTilesLinear.forward).
// Deterministic inference (tile_rows > 0): an fp32 block form covers every row count (q4_rows
// beyond any batch: BatchInvariantLinear.blocks), else the tiles or groups of the dense weight.
torch::Tensor gemv(const torch::Tensor& x, const Projection& w) {
  const bool f32 = x.scalar_type() == torch::kFloat;
  const int64_t t = x.size(0);
  if (!w.pieces.empty() && (t <= w.q4_rows || !w.dense.defined())) {  // QuantParts.matmul
    std::vector<torch::Tensor> outs;
    for (const Projection& piece : w.pieces) outs.push_back(gemv(x, piece));
    torch::Tensor out = torch::cat(outs, 1);
    return w.bias.defined() ? out + w.bias : out;
  }
  if (w.codes.defined() && (t <= w.q4_rows || !w.dense.defined())) {
    const torch::Tensor xc = x.contiguous();
    torch::Tensor out;
    if (t > w.q4_rows)  // no dense copy: many rows through dequantized tiles (DequantTilesLinear)
      out = w.q8 ? q8_tiles_mm(xc, w.codes, w.scales, optional(w.offsets))
                 : q4_tiles_mm(xc, w.codes, w.scales, w.offsets, w.out_features);
    else if (w.q8)  // cpu_quant.q8_gemv: lane order for a bf16 x, else the fp32 loops
      out = q8_blocks_gemv(xc, w.codes, w.scales, optional(w.offsets), true);
    else
      out = f32 ? q4_gemv_f32(xc, w.codes, w.scales, w.offsets, w.out_features, true)
                : q4_gemv(xc, w.codes, w.scales, w.offsets, w.out_features, true);
    return w.bias.defined() ? out + w.bias : out;
  }
  if (w.dense.dim() == 4)  // VNNI pairs (VnniLinear): every row count, each row's bits fixed whatever the batch
    return vnni_linear(x, w.dense, optional(w.bias), w.out_features);
  if (w.tile_rows > 0) return f32 ? grouped_gemv_f32(x, w) : tiled_dense(x, w);
  if (f32) return t <= w.small_rows ? gemv_f32(x, w.dense, optional(w.bias)) : at::linear(x, w.dense, optional(w.bias));
  return dense_linear(x, w.dense, w.bias);
}

// engine/layers/norm.py rms_norm in the same torch ops (transformers' RMSNorm: fp32 statistics,
// cast back, then the weight), as Qwen3's q/k norm runs it on the [T, H + KVH, D] slab.
torch::Tensor torch_rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  torch::Tensor h = x.to(torch::kFloat32);
  const torch::Tensor variance = h.pow(2).mean({-1}, true);
  h = h * torch::rsqrt(variance + eps);
  return w * h.to(x.scalar_type());
}

// engine/layers/activation.py silu_and_mul: silu(gate) * up (the halves as views, as chunk gives them).
torch::Tensor torch_silu_mul(const torch::Tensor& gate_up) {
  const int64_t half = gate_up.size(-1) / 2;
  return torch::silu(gate_up.narrow(-1, 0, half)) * gate_up.narrow(-1, half, half);
}

// FusedMoE.forward on one rank with its experts in blocks or (forwards within the kernel's bound,
// which the Python side checks) its dense experts' one-call kernel: FusedMoE.route's ops (the router's
// logits in the model dtype, softmax in fp32, top-k, divided by their sum when renormalizing, the
// weights in the model dtype unless fp32_weights), then the experts (cpu_moe_quant.cpp).
torch::Tensor moe_mlp(const torch::Tensor& x, const DecodeLayer& l) {
  const torch::Tensor logits =
      moe_router_logits(x, l.router, l.router_packed.defined() ? std::optional(l.router_packed) : std::nullopt);
  const torch::Tensor probs = at::softmax(logits, -1, torch::kFloat);
  auto [weights, ids] = at::topk(probs, l.top_k, -1);
  if (l.renormalize) weights = weights / weights.sum(-1, true);
  if (!l.fp32_weights) weights = weights.to(logits.scalar_type());
  if (l.experts) return l.experts->forward(x, ids, weights.to(torch::kFloat));
  return moe_experts(x, l.experts_w13, l.experts_w2, ids, weights.to(torch::kFloat));
}

}  // namespace

Projection make_projection(const std::vector<torch::Tensor>& parts, int64_t out_features, int64_t q4_rows) {
  return projection(parts, out_features, q4_rows, std::nullopt, 0, 0);
}

torch::Tensor project_rows(const torch::Tensor& x, const Projection& w) { return gemv(x, w); }

void set_projection_pieces(Projection& p, const std::vector<std::vector<torch::Tensor>>& pieces,
                           const std::vector<int64_t>& piece_out, int64_t q4_rows) {
  TORCH_CHECK(!pieces.empty() && pieces.size() == piece_out.size(), "pieces: one output width per piece");
  TORCH_CHECK(!p.codes.defined(), "pieces: the projection has one quantized form already");
  int64_t total = 0;
  p.pieces.clear();
  for (size_t i = 0; i < pieces.size(); ++i) {
    TORCH_CHECK(pieces[i].size() == 2 || pieces[i].size() == 3, "pieces: each a quantized form only");
    // the projection's bound: above it a piece without a dense copy runs its dequantized tiles
    p.pieces.push_back(projection(pieces[i], piece_out[i], q4_rows, std::nullopt, 0, 0));
    total += piece_out[i];
  }
  TORCH_CHECK(total == p.out_features, "pieces: their outputs must add up to the projection's");
  p.q4_rows = q4_rows;
}

DecodeLayers::DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scaling)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scaling_(scaling) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0, "head shapes");
}

void DecodeLayers::add_layer(torch::Tensor input_norm, std::vector<torch::Tensor> qkv, int64_t qkv_out,
                             std::vector<torch::Tensor> o, int64_t o_out, torch::Tensor post_norm,
                             std::vector<torch::Tensor> gate_up, int64_t gate_up_out, std::vector<torch::Tensor> down,
                             int64_t down_out, torch::Tensor k_buffer, torch::Tensor v_buffer,
                             std::vector<int64_t> q4_rows, std::vector<std::optional<torch::Tensor>> biases,
                             std::optional<torch::Tensor> qk_norm, int64_t tile_rows, int64_t small_rows) {
  TORCH_CHECK(biases.size() == 4 && q4_rows.size() == 4,
              "one bias (or None) and one row bound per projection: q|k|v, o, gate|up, down");
  TORCH_CHECK(qkv_out == (num_heads_ + 2 * num_kv_heads_) * head_dim_, "q|k|v rows must match the heads");
  TORCH_CHECK(o_out == down_out && gate_up_out % 2 == 0, "o and down give the hidden size; gate|up is two halves");
  TORCH_CHECK(k_buffer.dim() == 3 && k_buffer.size(1) == num_kv_heads_ && k_buffer.size(2) == head_dim_ &&
                  v_buffer.sizes() == k_buffer.sizes(),
              "KV buffers [S, KVH, D]");
  layers_.push_back(DecodeLayer{input_norm, post_norm, qk_norm.value_or(torch::Tensor()),
                                projection(qkv, qkv_out, q4_rows[0], biases[0], tile_rows, small_rows),
                                projection(o, o_out, q4_rows[1], biases[1], tile_rows, small_rows),
                                projection(gate_up, gate_up_out, q4_rows[2], biases[2], tile_rows, small_rows),
                                projection(down, down_out, q4_rows[3], biases[3], tile_rows, small_rows), k_buffer,
                                v_buffer});
}

void DecodeLayers::set_pieces(int64_t layer, int64_t which, std::vector<std::vector<torch::Tensor>> pieces,
                              std::vector<int64_t> piece_out, int64_t q4_rows) {
  TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= which && which < 4, "pieces: layer or projection");
  DecodeLayer& l = layers_[layer];
  set_projection_pieces(which == 0 ? l.qkv : which == 1 ? l.o : which == 2 ? l.gate_up : l.down, pieces, piece_out,
                        q4_rows);
}

void DecodeLayers::set_moe(int64_t layer, torch::Tensor router, std::optional<torch::Tensor> router_packed,
                           std::shared_ptr<QuantExperts> experts, std::optional<torch::Tensor> w13,
                           std::optional<torch::Tensor> w2, int64_t top_k, bool renormalize, bool fp32_weights) {
  TORCH_CHECK(0 <= layer && layer < num_layers(), "MoE: layer");
  TORCH_CHECK((experts != nullptr) != (w13.has_value() && w2.has_value()), "MoE: experts in blocks or dense stacks");
  const int64_t count = experts ? experts->num_experts() : w13->size(0);
  TORCH_CHECK(experts || (w13->dim() == 3 && w2->dim() == 3 && w2->size(0) == count), "MoE: w13 [E, 2I, H], w2 [E, H, I]");
  TORCH_CHECK(router.dim() == 2 && router.size(0) == count, "MoE: router [E, hidden]");
  TORCH_CHECK(0 < top_k && top_k <= count, "MoE: 0 < top_k <= E");
  DecodeLayer& l = layers_[layer];
  TORCH_CHECK(!l.gate_up.codes.defined() && !l.gate_up.dense.defined() && l.gate_up.pieces.empty(),
              "MoE: the layer was added without a dense MLP");
  l.experts = std::move(experts);
  if (w13.has_value()) {
    l.experts_w13 = *w13;
    l.experts_w2 = *w2;
  }
  l.router = router;
  l.router_packed = router_packed.value_or(torch::Tensor());
  l.top_k = top_k;
  l.renormalize = renormalize;
  l.fp32_weights = fp32_weights;
}

void DecodeLayers::set_lora(int64_t layer, int64_t projection, torch::Tensor a, torch::Tensor bt,
                            torch::Tensor scaling, std::vector<int64_t> part_sizes, int64_t rank) {
  TORCH_CHECK(0 <= layer && layer < num_layers() && 0 <= projection && projection < 4, "LoRA: layer or projection");
  layers_[layer].lora[projection] = lora_projection(a, bt, scaling, std::move(part_sizes), rank);
}

torch::Tensor DecodeLayers::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                    torch::Tensor out_cache_loc, torch::Tensor slots, torch::Tensor lens,
                                    std::optional<torch::Tensor> prefix_lens, std::optional<torch::Tensor> query_starts,
                                    std::optional<torch::Tensor> lora_slots) const {
  const int64_t t = x.size(0), h = num_heads_, kvh = num_kv_heads_, d = head_dim_;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out_cache_loc.numel() == t, "x [T, hidden], one slot per token");
  const int64_t* row_slots = nullptr;  // the LoRA deltas' per-token slots (ops.py's, applied after each projection)
  if (lora_slots.has_value()) {
    TORCH_CHECK(lora_slots->scalar_type() == torch::kLong && lora_slots->is_contiguous() && lora_slots->numel() == t,
                "lora_slots: int64 [T]");
    row_slots = lora_slots->data_ptr<int64_t>();
  }
  // gemv, then this projection's LoRA deltas where the forward has adapter rows
  auto project = [row_slots](const torch::Tensor& in, const Projection& w, const LoRAProjection& lora) {
    torch::Tensor out = gemv(in, w);
    if (row_slots != nullptr) add_lora(in, out, lora, row_slots);
    return out;
  };
  // fp32: the Python layers' elementwise steps with their torch roundings (see the file comment)
  const bool f32 = x.scalar_type() == torch::kFloat;
  TORCH_CHECK(layers_.empty() || layers_[0].k_buffer.scalar_type() == x.scalar_type(), "x and the KV pool: one dtype");
  for (const DecodeLayer& layer : layers_) {
    const torch::Tensor normed_in = f32 ? f32_rms_norm(x, layer.input_norm, eps_) : rms_norm(x, layer.input_norm, eps_);
    const torch::Tensor qkv = project(normed_in, layer.qkv, layer.lora[0]);
    // q and k are adjacent: normalise (Qwen3) and rotate them as one [T, H + KVH, D] slab (as
    // LlamaAttention does)
    torch::Tensor qk = qkv.narrow(1, 0, (h + kvh) * d).view({t, h + kvh, d});
    if (layer.qk_norm.defined())  // bf16: the fused per-head kernel, as QKNorm runs it
      qk = f32 ? torch_rms_norm(qk, layer.qk_norm, eps_) : rms_norm_heads(qk, layer.qk_norm, eps_, false);
    qk = f32 ? f32_rotary(qk, cos, sin) : rotary(qk, cos, sin);
    const torch::Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d).view({t, kvh, d});
    store_rows(layer.k_buffer, out_cache_loc, qk.narrow(1, h, kvh));
    store_rows(layer.v_buffer, out_cache_loc, v);
    const torch::Tensor q = qk.narrow(1, 0, h).contiguous();
    const torch::Tensor attn =
        prefix_lens.has_value()
            ? extend_attention(q, layer.k_buffer, layer.v_buffer, slots, *prefix_lens, lens, scaling_, 0.0, 0)
            : decode_attention(q, layer.k_buffer, layer.v_buffer, slots, lens, scaling_, query_starts, 0.0)[0];
    const torch::Tensor attn_out = project(attn.view({t, h * d}), layer.o, layer.lora[1]);
    torch::Tensor normed;
    if (f32) {  // AddRMSNorm's torch form: a new residual sum, then the norm
      x = x + attn_out;
      normed = f32_rms_norm(x, layer.post_norm, eps_);
    } else {
      normed = add_rms_norm_(x, attn_out, layer.post_norm, eps_);
    }
    if (layer.experts || layer.experts_w13.defined()) {
      x = x + moe_mlp(normed, layer);
      continue;
    }
    const torch::Tensor gate_up = project(normed, layer.gate_up, layer.lora[2]);
    x = x + project(f32 ? torch_silu_mul(gate_up) : silu_mul(gate_up), layer.down, layer.lora[3]);
  }
  return x;
}

}  // namespace asyncllm
