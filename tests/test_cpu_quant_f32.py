"""Block-quantized products for fp32 activations (csrc/cpu_quant_gemv_f32.cpp) and the fp32 model
that runs them: a GGUF's 4-bit layers and Q8_0 head read as stored (an eighth and a quarter of the
dense fp32 bytes) instead of dequantized to fp32.

Pinned here: the vector loops equal the plain loops to the bit (same sums, same order) and are as
close to an fp64 matmul of the dequantized weight as MKL's fp32 matmul is; x = I reads back the
exact dequantized weights; a row's result is the same bits in any batch, at any position and on
any thread count; bad inputs are errors; and the default model in fp32 takes these kernels for
its decode steps and still gives transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_extension, cpu_quant
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import DenseLinear, DequantTilesLinear, QuantLinear
from engine.layers.q8 import Q8Weight
from tests.quant_blocks import random_q4, random_q8

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="the CPU kernels cannot be built here")
vector_only = pytest.mark.skipif(
    not cpu_quant.vectorized(torch.float32), reason="no AVX2+FMA+F16C (or AVX-512) build: fp32 models stay dense"
)


def _err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    return (out.double() - x.double() @ w.double().T).abs().max().item()


@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 128), (960, 576), (7, 192), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
def test_q4_equals_plain_loop_and_is_as_close_to_fp64_as_mkl(n, k, rows):
    blocks = random_q4(n, k, seed=n + k)
    packed = cpu_quant.q4_pack(blocks.q, blocks.scale, blocks.offset)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    plain = cpu_quant.q4_gemv(x, packed, vector=False)
    assert plain.shape == (rows, n) and plain.dtype == torch.float32
    w = blocks.dequantize()
    mkl = _err(torch.nn.functional.linear(x, w), x, w)
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert _err(plain, x, w) <= max(4 * mkl, 1e-6 * scale)
    if cpu_quant.vectorized(torch.float32):
        assert torch.equal(cpu_quant.q4_gemv(x, packed), plain)


@pytest.mark.parametrize(("n", "k"), [(100, 192), (49152 // 16, 576), (5, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
def test_q8_equals_plain_loop_and_is_as_close_to_fp64_as_mkl(n, k, rows):
    blocks = random_q8(n, k, seed=rows + n)
    w, half = blocks.dequantize(), blocks.scale.half()
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(7))
    plain = cpu_quant.q8_gemv(x, blocks.q, half, vector=False)
    assert plain.shape == (rows, n) and plain.dtype == torch.float32
    mkl = _err(torch.nn.functional.linear(x, w), x, w)
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    assert _err(plain, x, w) <= max(4 * mkl, 1e-6 * scale)
    if cpu_quant.vectorized(torch.float32):
        assert torch.equal(cpu_quant.q8_gemv(x, blocks.q, half), plain)


@vector_only
def test_identity_reads_back_the_exact_dequantized_weights():
    """fp32 holds every d * q + m of fp16 d, m exactly after one rounding, as gguf's own
    dequantization computes it: x = I must return W to the bit."""
    n, k = 40, 192
    blocks = random_q4(n, k, seed=3)
    form = blocks.pack(torch.float32)
    assert isinstance(form, TiledQ4Weight)
    eye = torch.eye(k)
    assert torch.equal(form.matmul(eye).T, blocks.dequantize())
    q8 = random_q8(n, k, seed=4)
    q8_form = q8.pack(torch.float32)
    assert isinstance(q8_form, Q8Weight)
    assert torch.equal(q8_form.matmul(eye).T, q8.dequantize())


@vector_only
def test_a_rows_result_is_the_same_bits_in_any_batch_and_thread_count():
    blocks, head = random_q4(3072, 576, seed=5), random_q8(2048, 576, seed=6)
    form, head_form = blocks.pack(torch.float32), head.pack(torch.float32)
    probe = torch.randn(576, generator=torch.Generator().manual_seed(8))
    alone = (form.matmul(probe[None])[0], head_form.matmul(probe[None])[0])
    threads = torch.get_num_threads()
    for m in (2, 3, 4, 5, 8, 13):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        for at in {0, m // 2, m - 1}:
            x[at] = probe
            assert torch.equal(form.matmul(x)[at], alone[0]), (m, at)
            assert torch.equal(head_form.matmul(x)[at], alone[1]), (m, at)
    for t in {1, max(threads, 2)}:
        try:
            torch.set_num_threads(t)
            assert torch.equal(form.matmul(probe[None])[0], alone[0]), t
            assert torch.equal(head_form.matmul(probe[None])[0], alone[1]), t
        finally:
            torch.set_num_threads(threads)


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    packed = cpu_quant.q4_pack(*(lambda b: (b.q, b.scale, b.offset))(random_q4(16, 64, seed=0)))
    with pytest.raises(RuntimeError, match=r"contiguous \[M, K\]"):
        cpu_quant.q4_gemv(torch.randn(1, 128), packed)
    with pytest.raises(RuntimeError, match="at least one row"):
        cpu_quant.q4_gemv(torch.randn(0, 64), packed)
    with pytest.raises(RuntimeError, match="bf16"):  # neither fp32 nor bf16: the bf16 loops refuse it
        cpu_quant.q4_gemv(torch.randn(1, 64).half(), packed)
    with pytest.raises(RuntimeError, match=r"codes int8 \[N, K\]"):  # (uint8 codes are the bf16 loops' lane order)
        cpu_quant.q8_gemv(torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int16), torch.ones(4, 2).half())
    with pytest.raises(RuntimeError, match="fp16 scales"):
        cpu_quant.q8_gemv(torch.randn(1, 64), torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3).half())


@vector_only
def test_pack_forms_per_dtype():
    blocks = random_q4(32, 256, seed=1)
    assert isinstance(blocks.pack(torch.float32), TiledQ4Weight)
    # K = 96 is not a multiple of 64: no fp32 form at all (torch's int4pack takes bf16 only)
    assert random_q4(16, 96, seed=2).pack(torch.float32) is None
    assert random_q4(16, 64, seed=2).pack(torch.float16) is None
    assert isinstance(random_q8(4, 64, seed=1).pack(torch.float32), Q8Weight)


@vector_only
def test_default_model_fp32_decodes_on_the_blocks_with_transformers_tokens(
    default_source, default_tokenizer, hf_default_model
):
    """The default GGUF in fp32: every layer projection keeps its Q4_1 tiles and the head its
    Q8_0 blocks (the values transformers dequantizes), decode steps of 1 to 6 requests run on
    them (counted through the Python layers; the fused C++ loop, the default, calls the same
    kernels), and the greedy tokens are transformers' on both paths."""
    from bench.parity_prompts import parity_prompts
    from engine import SyncScheduler
    from engine.model_executor.model_runner import ModelRunner
    from engine.sampling import SamplingParams
    from engine.server_args import ServerArgs
    from tests.hf_reference import hf_greedy_outputs

    def runner(**kw) -> ModelRunner:
        args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=6, **kw)
        return ModelRunner(args, default_source)

    python_layers = runner(q4_max_tokens=8, disable_fused_decode=True)
    model = python_layers.model
    layer = model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(proj, QuantLinear) and isinstance(proj.packed, TiledQ4Weight) and proj.max_rows == 8
        # the only resident form: more rows run the tiles dequantized to fp32 (prefills here)
        assert isinstance(proj.big, DequantTilesLinear) and proj.big.dtype == torch.float32
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.lm_head.packed, Q8Weight)
    calls, real = {"n": 0}, cpu_quant.q4_gemv

    def counting(x, *a, **kw):
        assert x.dtype == torch.float32
        calls["n"] += 1
        return real(x, *a, **kw)

    prompts = parity_prompts(default_tokenizer)[:6]
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    expected = hf_greedy_outputs(hf_default_model, prompts, 32)
    sched = SyncScheduler(python_layers)
    cpu_quant.q4_gemv = counting
    try:
        reqs = [sched.add_request(p, params) for p in prompts]
        sched.run_until_idle()
    finally:
        cpu_quant.q4_gemv = real
    assert calls["n"] >= 31 * 4 * len(model.layers)  # every decode step's every projection
    assert [r.output_ids for r in reqs] == expected
    fused = runner(q4_max_tokens=8)
    assert fused.model.fused_decode is not None
    assert [r.output_ids for r in SyncScheduler(fused).generate(prompts, params)] == expected


@vector_only
def test_fp32_quantized_path_is_measured_by_default_and_off_where_asked(default_source):
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    base = dict(dtype="float32", device="cpu", max_total_tokens=1024, max_running_requests=2)
    assert ServerArgs(**base).resolved_q4_max_tokens() is None  # measured at load
    off = ModelRunner(ServerArgs(**base, q4_max_tokens=0), default_source).model
    assert type(off.layers[0].mlp.down_proj) is DenseLinear and type(off.lm_head) is DenseLinear
    tiled = ModelRunner(ServerArgs(**base, enable_deterministic_inference=True), default_source).model
    assert not any(isinstance(m, QuantLinear) for m in tiled.modules())  # fixed dense tiles only
