"""Weight-only quantization of Hugging Face checkpoints at load (`--torchao-config`, issue 33):
the quantization itself, the engine computing with exactly the quantized values (fp32 greedy
tokens equal transformers' on the same dequantized weights, fp32 decode steps on the blocks), the
quantized kernels in use in bf16, and the refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Phi3Config

from bench.gpu_parity import teacher_forced
from engine import ServerArgs, SyncScheduler
from engine.errors import InvalidServerArgsError
from engine.kernels import cpu_quant
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import QuantLinear
from engine.layers.q8 import Q8Weight
from engine.layers.weight_quant import WeightOnlyQuant, quantize_q4, quantize_q8
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from server.cli import parse_args
from tests.test_model_families import BF16_SHAPE, NO_SPECIAL, assert_scheduler_matches_transformers, save_random_model
from tests.test_model_parity import COMMON as PARITY_SHAPE

SHAPE = PARITY_SHAPE | dict(intermediate_size=128) | NO_SPECIAL  # every projection's K a multiple of 64
INIT = (0.3, 0.5, 1.5, 0.3)
BF16_INIT = (0.08, 0.1, 0.4, 2.0)  # spread logits: tiny bf16 models are near-tie-prone
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def test_quantized_blocks_are_close_and_in_range():
    """Every weight is within half a step of its block's grid (plus the fp16 scale's rounding),
    codes stay in range, and a constant 4-bit group (scale 0) comes back exactly."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 0.05
    w[3, :64] = 0.25  # constant groups
    q8 = quantize_q8(w)
    assert q8.q.dtype == torch.int8 and int(q8.q.abs().max()) <= 127
    err8 = (q8.dequantize() - w).abs().view(48, 8, 32)
    assert bool((err8 <= q8.scale.unsqueeze(-1) * 0.5 + 1e-6).all())
    for group in (32, 64, 128):
        q4 = quantize_q4(w, group)
        assert q4.q.dtype == torch.uint8 and int(q4.q.max()) <= 15 and q4.group_size == group
        err4 = (q4.dequantize() - w).abs().view(48, 256 // group, group)
        step = q4.scale.unsqueeze(-1)
        assert bool((err4 <= step * 0.5 + 2e-3 * w.abs().max()).all())  # the fp16 offset's rounding too
        if group <= 64:  # the constant run fills the row's first group
            assert torch.equal(q4.dequantize()[3, :group], w[3, :group])


def test_q8_blocks_are_gguf_q8_0():
    """Our int8wo blocks, written as GGUF Q8_0 bytes, dequantize through the gguf package to
    exactly our values: the format is llama.cpp's."""
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))
    q8 = quantize_q8(w)
    d = q8.scale.to(torch.float16).numpy().view(np.uint8).reshape(8, 4, 2)
    raw = np.concatenate([d, q8.q.numpy().view(np.uint8).reshape(8, 4, 32)], axis=-1).reshape(8, -1)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(theirs, q8.dequantize().numpy())


def quantized_reference(hf, spec: str):
    """transformers' model with each decoder-layer projection replaced by its quantized values."""
    quant = WeightOnlyQuant.parse(spec)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in PROJECTIONS and name.endswith("weight"):
                if quant.applies_to(p):
                    p.copy_(quant.quantize(p).dequantize())
    return hf


@pytest.mark.parametrize(
    ("family", "spec"),
    [("llama", "int8wo"), ("llama", "int4wo-64"), ("phi3", "int4wo-32")],
)
def test_fp32_greedy_tokens_equal_transformers_on_the_quantized_values(family, spec, tmp_path):
    """fp32: the engine computes with exactly the quantized values, fused q|k|v and gate|up parts
    included (Phi-3 splits its fused tensors before quantizing): decode steps of up to 8 rows on
    the blocks through our fp32 kernels where they are vectorized (csrc/cpu_quant_gemv_f32.cpp),
    16-row prefill chunks on the dequantized dense weights."""
    cfg = LlamaConfig(**SHAPE) if family == "llama" else Phi3Config(**SHAPE)
    hf = quantized_reference(save_random_model(cfg, INIT, tmp_path), spec)
    args = ServerArgs(
        model_path=str(tmp_path), dtype="float32", device="cpu", max_total_tokens=4096,
        max_running_requests=8, chunked_prefill_size=16, torchao_config=spec, q4_max_tokens=8,
    )  # fmt: skip
    runner = ModelRunner(args)
    if cpu_quant.vectorized(torch.float32):
        form = Q8Weight if spec == "int8wo" else TiledQ4Weight
        for layer in runner.model.layers:
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                assert isinstance(proj, QuantLinear) and isinstance(proj.packed, form) and proj.max_rows == 8
    assert_scheduler_matches_transformers(runner, hf, f"{family} {spec}")


@pytest.mark.parametrize("spec", ["int8wo", "int4wo-32", "int4wo-128"])
def test_bf16_small_batches_run_the_quantized_kernels(spec, tmp_path):
    """bf16 on a CPU: every decoder-layer projection keeps its quantized form (Q8_0 or our 4-bit
    tiles) beside its dense one, both kinds in the fused decode loop; greedy tokens are
    transformers' top choices on the quantized values."""
    if not cpu_quant.vectorized():
        pytest.skip("the quantized CPU kernels need AVX512-BF16 (the dense path is covered in fp32)")
    # the reference in fp32: the quantized kernels compute with the exact values d * q + m
    # (the bf16 dense form rounds them to 8 significant bits)
    hf = quantized_reference(save_random_model(LlamaConfig(**BF16_SHAPE), BF16_INIT, tmp_path), spec)
    args = ServerArgs(
        model_path=str(tmp_path), dtype="bfloat16", device="cpu", max_total_tokens=4096,
        max_running_requests=8, torchao_config=spec, q4_max_tokens=8,
    )  # fmt: skip
    runner = ModelRunner(args)
    form = Q8Weight if spec == "int8wo" else TiledQ4Weight
    for layer in runner.model.layers:
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(proj, QuantLinear) and isinstance(proj.packed, form) and proj.max_rows == 8
    assert not isinstance(runner.model.lm_head, QuantLinear)  # the head stays as stored
    assert runner.model.fused_decode is not None
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 37, 12, 60, 20, 90)]
    sched = SyncScheduler(runner)
    reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=24)) for p in prompts]
    sched.run_until_idle()
    bar = teacher_forced(hf, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], bar


def test_torchao_config_refusals(tmp_path):
    """An unknown value, tensor parallelism and a GGUF are typed errors naming the option."""
    with pytest.raises(InvalidServerArgsError) as e:
        ServerArgs(torchao_config="int4wo-100").verify()
    assert e.value.param == "torchao_config" and "int4wo-128" in str(e.value)
    with pytest.raises(InvalidServerArgsError) as e:
        ServerArgs(torchao_config="int8wo", tp_size=2).verify()
    assert e.value.param == "torchao_config"
    with pytest.raises(InvalidServerArgsError) as e:
        ModelRunner(ServerArgs(device="cpu", torchao_config="int8wo", max_total_tokens=256))  # the default GGUF
    assert e.value.param == "torchao_config" and "GGUF" in str(e.value)


def test_cli_passes_torchao_config():
    engine, _ = parse_args(["--model-path", "m", "--torchao-config", "int4wo-128", "--torch-threads", "2"])
    assert engine["torchao_config"] == "int4wo-128" and engine["torch_threads"] == 2
    with pytest.raises(SystemExit):
        parse_args(["--torchao-config", "int3wo"])
