// The Python module: every CPU kernel entry point (their argument checks live next to them).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "decode_layers.h"
#include "moe_quant.h"

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                            torch::Tensor slots, torch::Tensor lens, double scale,
                                            std::optional<torch::Tensor> query_starts, double softcap);
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens, double scale, double softcap,
                               int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rms_norm_unit_offset(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rms_norm_heads(torch::Tensor x, torch::Tensor table, double eps, bool unit_offset);
torch::Tensor add_unit_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, std::optional<torch::Tensor> w_next,
                             double eps);
torch::Tensor gelu_tanh_mul(torch::Tensor gate_up);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor argmax_rows(torch::Tensor x);
bool quant_gemv_vectorized();
void set_q4_int8_activations(bool on);
bool q4_int8_activations();
namespace asyncllm {
bool attention_bf16dot_built();
}
torch::Tensor q4_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                      int64_t n_out, bool vectorized);
torch::Tensor q8_lanes_pack(torch::Tensor codes, int64_t kind);
torch::Tensor q8_blocks_gemv(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                             std::optional<torch::Tensor> supers, bool vectorized);
bool quant_gemv_f32_vectorized();
torch::Tensor q4_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out);
torch::Tensor q8_tiles_mm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                          std::optional<torch::Tensor> supers);
torch::Tensor bf16_tiles_mm(torch::Tensor x, torch::Tensor w);
bool vnni_linear_built();
torch::Tensor vnni_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t n_out);
torch::Tensor quant_dequantize(torch::Tensor codes, torch::Tensor scales, std::optional<torch::Tensor> offsets,
                               int64_t n_out, torch::ScalarType dtype);
torch::Tensor q4_gemv_f32(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                          int64_t n_out, bool vectorized);
torch::Tensor lora_add_(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor bt, torch::Tensor scaling,
                        std::vector<int64_t> part_sizes, int64_t rank, torch::Tensor row_slots);
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor ids,
                          torch::Tensor weights);
torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
void bind_quant_experts(pybind11::module& m);  // cpu_moe_quant.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // This library's copy of ATen's once-per-thread thread-count init runs at its first parallel
  // call on a thread and adopts torch's process-wide count (the last torch.set_num_threads of any
  // thread), not the thread's own; calling this settles it at a moment of the caller's choosing.
  m.def(
      "num_threads",
      [] {
        at::internal::lazy_init_num_threads();  // this library's copy (inline in ATen/Parallel.h)
        return at::get_num_threads();
      },
      "settle this thread's intra-op threads for these kernels; returns them");
  m.def("decode_attention", &decode_attention, "paged decode attention (out, lse) on CPU", py::arg("q"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("slots"), py::arg("lens"), py::arg("scale"),
        py::arg("query_starts") = py::none(), py::arg("softcap") = 0.0);
  m.def("extend_attention", &extend_attention, "paged causal extend/prefill attention on CPU", py::arg("q"),
        py::arg("k_buf"), py::arg("v_buf"), py::arg("slots"), py::arg("prefix_lens"), py::arg("extend_lens"),
        py::arg("scale"), py::arg("softcap") = 0.0, py::arg("window") = 0);
  m.def("attention_bf16dot_built", &asyncllm::attention_bf16dot_built,
        "whether bf16 decode attention reads a slot row once for all its queries (vdpbf16ps kernels)");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows");
  m.def("add_rms_norm_", &add_rms_norm_, "x += y (bf16), then RMSNorm of x");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a bf16 [T, 2I] gate|up slab");
  m.def("rms_norm_unit_offset", &rms_norm_unit_offset, "Gemma's (1 + w) RMSNorm of bf16 rows");
  m.def("rms_norm_heads", &rms_norm_heads, "each bf16 head of a [T, NH, D] slab normalised with its own weight row",
        py::arg("x"), py::arg("table"), py::arg("eps"), py::arg("unit_offset"));
  m.def("add_unit_norm_", &add_unit_norm_, "x += unit_norm(y, w) (bf16), then unit_norm(x, w_next) or x",
        py::arg("x"), py::arg("y"), py::arg("w"), py::arg("w_next"), py::arg("eps"));
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up of a bf16 [T, 2I] gate|up slab");
  m.def("rotary", &rotary, "rotary embedding of bf16 [T, NH, D] heads");
  m.def("argmax_rows", &argmax_rows, "argmax of each bf16/fp32 row (torch.argmax(dim=-1)'s answer)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_gemv_vectorized", &quant_gemv_vectorized, "whether q4_gemv and the lane-order 8-bit loops run vectorized here");
  // the quantized products and the fused layers release the GIL: the event loop runs meanwhile
  m.def("set_q4_int8_activations", &set_q4_int8_activations,
        "whether q4_gemv reads a bf16 x in int8 blocks (VNNI dot products) or exactly (bf16 ones)");
  m.def("q4_int8_activations", &q4_int8_activations, "the set_q4_int8_activations setting");
  m.def("q4_gemv", &q4_gemv, "bf16 x [M, K] @ W.T, W in 4-bit blocks (cpu_quant.q4_pack layout)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemv_f32", &gemv_f32, "fp32 x [M <= 8, K] @ W.T (+ b), W streamed once (engine/kernels/cpu_gemv.py)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("q8_lanes_pack", &q8_lanes_pack, "int8 codes of an 8-bit kind (0 Q8_0, 1 Q6_K, 2 Q5_K) in lane order");
  m.def("moe_router_logits", &asyncllm::moe_router_logits,
        "a MoE router's logits x @ gate.T: a few bf16 rows through its own loop, more through the prepacked form",
        py::arg("x"), py::arg("gate"), py::arg("packed"), py::call_guard<py::gil_scoped_release>());
  m.def("q8_blocks_gemv", &q8_blocks_gemv,
        "x [M, K] @ W.T, W in 8-bit blocks: lane order (uint8 codes, bf16 x) or natural (int8 codes, fp32 loops)",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("supers"), py::arg("vectorized"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_gemv_f32_vectorized", &quant_gemv_f32_vectorized,
        "whether q4_gemv_f32 and the natural-order 8-bit loops run vectorized here (AVX2+FMA+F16C or AVX-512F)");
  m.def("q4_gemv_f32", &q4_gemv_f32, "fp32 x [M, K] @ W.T, W in 4-bit blocks (cpu_quant.q4_pack layout)",
        py::call_guard<py::gil_scoped_release>());
  m.def("q4_tiles_mm", &q4_tiles_mm, "bf16/fp32 x [M, K] @ W.T for many rows, W in 4-bit tiles, through dequantized tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_tiles_mm", &q8_tiles_mm, "x [M, K] @ W.T for many rows, W in 8-bit blocks, through dequantized tiles",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("supers"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_tiles_mm", &bf16_tiles_mm, "bf16 x [M, K] @ W.T for a plain bf16 W [N, K] through VNNI-repacked tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("vnni_linear_built", &vnni_linear_built,
        "whether vnni_linear is built here and is the bf16 dense form (AVX512-BF16, no AMX)");
  m.def("vnni_linear", &vnni_linear, "bf16 x [M, K] @ W.T (+ b), W resident in VNNI pairs [ceil(N/64), K/2, 64, 2]",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n_out"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_dequantize", &quant_dequantize, "a block-quantized weight's W [N, K] in bf16 or fp32",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_add_", &lora_add_, "y += each row's LoRA delta (bf16 or fp32, engine/lora/ops.py's CPU path)",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_experts", &moe_experts, "a MoE layer's experts for a few bf16 or fp32 tokens (engine/layers/moe.py)",
        py::call_guard<py::gil_scoped_release>());
  bind_quant_experts(m);
  py::class_<asyncllm::DecodeLayers>(m, "DecodeLayers")
      .def(py::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &asyncllm::DecodeLayers::add_layer)
      .def("num_layers", &asyncllm::DecodeLayers::num_layers)
      .def("set_pieces", &asyncllm::DecodeLayers::set_pieces,
           "a fused projection's parts in blocks of different kinds, run side by side (QuantParts)")
      .def("set_moe", &asyncllm::DecodeLayers::set_moe,
           "a layer's mixture-of-experts MLP: router weight, experts in blocks (engine/layers/moe_quant.py)")
      .def("set_lora", &asyncllm::DecodeLayers::set_lora, "a projection's multi-LoRA buffers (engine/lora/pool.py)")
      .def("forward", &asyncllm::DecodeLayers::forward, "every layer of a small decode batch",
           py::call_guard<py::gil_scoped_release>());
}
