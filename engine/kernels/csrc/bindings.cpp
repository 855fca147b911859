// The Python module: every CPU kernel entry point (their argument checks live next to them).

#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf,
                                            torch::Tensor slots, torch::Tensor lens, double scale);
torch::Tensor extend_attention(torch::Tensor q, torch::Tensor k_buf, torch::Tensor v_buf, torch::Tensor slots,
                               torch::Tensor prefix_lens, torch::Tensor extend_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (out, lse) on CPU");
  m.def("extend_attention", &extend_attention, "paged causal extend/prefill attention on CPU");
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows");
  m.def("add_rms_norm_", &add_rms_norm_, "x += y (bf16), then RMSNorm of x");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a bf16 [T, 2I] gate|up slab");
  m.def("rotary", &rotary, "rotary embedding of bf16 [T, NH, D] heads");
}
