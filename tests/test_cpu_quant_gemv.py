"""Our block-quantized small-batch products (engine/kernels/cpu_quant.py, csrc/cpu_quant_gemv.cpp).

Pinned here: the vector loops agree with the plain loops (the reference arithmetic) and with an
fp64 matmul of the dequantized weight (with --q4-int8-activations, the 4-bit loops equal the plain
ones to the bit and fp64 on x's int8 blocks), for every row count (including more than one pass of 8
rows) and for row counts that leave the last 16-row tile partly padding; a weight read back
through the identity is the blocks' exact values; the default model's Q8_0 embedding is read as
gguf dequantizes it, and its bf16 runner takes these kernels for the layers and the LM head.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.kernels import cpu_extension, cpu_quant
from engine.layers.int4 import Q4Blocks, TiledQ4Weight
from engine.layers.linear import QuantLinear
from engine.layers.q8 import Q8Blocks, Q8Weight
from engine.models.gguf_blocks import q8_blocks
from tests.quant_blocks import random_q4, random_q8

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="the CPU kernels cannot be built here")
vector_only = pytest.mark.skipif(not cpu_quant.vectorized(), reason="no AVX512-BF16 build: the layers keep torch's")


def _rel_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().T
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 128), (960, 576), (7, 192)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 19])
def test_q4_matches_reference_and_fp64(n, k, rows):
    blocks = random_q4(n, k, seed=n + k)
    packed = cpu_quant.q4_pack(blocks.q, blocks.scale, blocks.offset)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    plain = cpu_quant.q4_gemv(x, packed, vector=False)
    assert plain.shape == (rows, n) and plain.dtype == torch.bfloat16
    assert _rel_err(plain, x, blocks.dequantize()) < 5e-3  # the output's bf16 rounding
    if cpu_quant.vectorized():
        fast = cpu_quant.q4_gemv(x, packed)
        assert _rel_err(fast, x, blocks.dequantize()) < 5e-3
        # fp32 sums in another order: at most one bf16 step apart
        assert torch.allclose(fast.float(), plain.float(), rtol=1 / 128, atol=1e-3 * plain.float().abs().max().item())


@pytest.fixture
def int8_x():
    """--q4-int8-activations for one test (process-wide in the extension), then off again."""
    cpu_quant.set_int8_activations(True)
    assert cpu_quant.int8_activations() == (cpu_extension.load() is not None)
    yield
    cpu_quant.set_int8_activations(False)


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as the bf16 4-bit kernel reads it (llama.cpp's Q8_1): each 32-wide block scaled to
    int8 by its largest magnitude, in fp32 as the kernel computes it."""
    b = x.float().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


@pytest.mark.parametrize(("n", "k"), [(48, 64), (40, 128), (960, 576), (7, 192)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 11, 19])
def test_q4_int8_x_matches_reference_and_fp64(n, k, rows, int8_x):
    """--q4-int8-activations: x is read in int8 blocks and each block's codes sum exactly in int32; only the offsets see
    x's exact block sums. Against fp64 on the int8 blocks' values the error is the output's bf16
    rounding; against the bf16 x, the int8 steps' (~1/254 of a block's largest value each)."""
    blocks = random_q4(n, k, seed=n + k)
    packed = cpu_quant.q4_pack(blocks.q, blocks.scale, blocks.offset)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    plain = cpu_quant.q4_gemv(x, packed, vector=False)
    assert plain.shape == (rows, n) and plain.dtype == torch.bfloat16
    scale = blocks.scale.double().repeat_interleave(32, dim=1)
    offset = blocks.offset.double().repeat_interleave(32, dim=1)
    ref = _int8_blocks(x) @ (blocks.q.double() * scale).T + x.double() @ offset.T
    assert ((plain.double() - ref).abs().max() / ref.abs().max()).item() < 5e-3
    assert _rel_err(plain, x, blocks.dequantize()) < 2e-2
    if cpu_quant.vectorized():  # the same integer sums and the same fp32 steps in the same order
        assert torch.equal(cpu_quant.q4_gemv(x, packed), plain)


def test_q4_int8_x_zero_blocks_and_extreme_values(int8_x):
    """A block of zeros has scale 0 (no division by it), a row of zeros gives exact zeros, and a
    block whose largest value is near bf16's range still rounds into int8 without overflow."""
    blocks = random_q4(32, 128, seed=5)
    packed = cpu_quant.q4_pack(blocks.q, blocks.scale, blocks.offset)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[0] = 0
    x[1, 32:64] = 0
    x[2, :32] *= 1e30
    plain = cpu_quant.q4_gemv(x, packed, vector=False)
    assert torch.equal(plain[0], torch.zeros(32, dtype=torch.bfloat16))
    assert torch.isfinite(plain).all()
    scale = blocks.scale.double().repeat_interleave(32, dim=1)
    offset = blocks.offset.double().repeat_interleave(32, dim=1)
    ref = _int8_blocks(x) @ (blocks.q.double() * scale).T + x.double() @ offset.T
    for r in (1, 2):
        assert ((plain[r].double() - ref[r]).abs().max() / ref[r].abs().max()).item() < 5e-3
    if cpu_quant.vectorized():
        assert torch.equal(cpu_quant.q4_gemv(x, packed), plain)


@pytest.mark.parametrize("rows", [1, 4, 9, 19])
def test_q8_matches_reference_and_fp64(rows):
    blocks = random_q8(100, 192, seed=rows)
    w = blocks.dequantize()
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    half = blocks.scale.half()
    plain = cpu_quant.q8_gemv(x, blocks.q, half, vector=False)
    assert _rel_err(plain, x, w) < 5e-3
    if cpu_quant.vectorized():
        assert _rel_err(cpu_quant.q8_gemv(x, blocks.q, half), x, w) < 5e-3


@vector_only
def test_identity_reads_back_the_exact_weights():
    """Dyadic scales and offsets: every weight is exact in bf16, so x = I returns W itself."""
    g = torch.Generator().manual_seed(3)
    n, k = 24, 128
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    blocks = Q4Blocks(
        q, torch.randint(1, 9, (n, 4), generator=g) / 8, -torch.randint(0, 17, (n, 4), generator=g) / 4, 32
    )
    form = blocks.pack()
    assert isinstance(form, TiledQ4Weight)
    eye = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(torch.cat([form.matmul(eye[i : i + 8]) for i in range(0, k, 8)]).float().T, blocks.dequantize())
    q8 = Q8Blocks(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.full((n, 4), 0.25))
    q8_form = q8.pack()
    assert isinstance(q8_form, Q8Weight)
    assert torch.equal(q8_form.matmul(eye).float().T, q8.dequantize())


@vector_only
def test_pack_takes_group_multiples_and_refuses_what_it_cannot_hold():
    blocks = random_q4(32, 256, seed=1)
    wide = Q4Blocks(blocks.q, blocks.scale[:, ::2].contiguous(), blocks.offset[:, ::2].contiguous(), 64)
    form = wide.pack()
    assert isinstance(form, TiledQ4Weight)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert _rel_err(form.matmul(x), x, wide.dequantize()) < 5e-3
    # K = 96 is not a multiple of 64, and a scale fp16 cannot hold: torch's form (or none) instead
    assert not isinstance(random_q4(16, 96, seed=2).pack(), TiledQ4Weight)
    odd = Q4Blocks(blocks.q, blocks.scale + 1e-6, blocks.offset, 32)
    assert not isinstance(odd.pack(), TiledQ4Weight)
    assert Q8Blocks(torch.zeros(4, 96, dtype=torch.int8), torch.ones(4, 3)).pack() is None


def test_bad_inputs_are_refused_not_read_out_of_bounds():
    packed = cpu_quant.q4_pack(*(lambda b: (b.q, b.scale, b.offset))(random_q4(16, 64, seed=0)))
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_quant.q4_gemv(torch.randn(1, 128).to(torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bf16"):  # fp32 x has its own loops (test_cpu_quant_f32.py)
        cpu_quant.q4_gemv(torch.randn(1, 64).half(), packed)
    with pytest.raises(RuntimeError, match="lane-order codes are Q6_K's or Q5_K's"):  # Q8_0 codes are int8
        cpu_quant.q8_gemv(
            torch.randn(1, 64).to(torch.bfloat16), torch.zeros(4, 64, dtype=torch.uint8), torch.ones(4, 2).half()
        )
    lanes = cpu_quant.q8_lanes_pack(torch.zeros(4, 256, dtype=torch.int8), cpu_quant.Q6_K)
    sc, d = torch.ones(4, 16, dtype=torch.int8), torch.ones(4, 1)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):  # the lane order's loops are bf16 only
        cpu_quant.q8_gemv(torch.randn(1, 256), lanes, sc, d)
    with pytest.raises(RuntimeError, match="int8 scales"):
        cpu_quant.q8_gemv(torch.randn(1, 256).bfloat16(), lanes, sc[:, :8].contiguous(), d)


def test_q8_blocks_are_the_gguf_values(default_source):
    info = next(t for t in default_source._gguf_index.tensors if t.name == "token_embd.weight")
    assert info.qtype == GGMLQuantizationType.Q8_0
    raw = np.fromfile(default_source.gguf_file, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
    raw = raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))
    blocks = q8_blocks(raw, info.shape)
    expect = torch.from_numpy(np.ascontiguousarray(dequantize(raw, info.qtype), dtype=np.float32)).reshape(info.shape)
    assert torch.equal(blocks.dequantize(), expect)


@vector_only
def test_default_model_runs_layers_and_head_on_our_kernels(default_source):
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    args = ServerArgs(device="cpu", max_total_tokens=512, max_running_requests=2, q4_max_tokens=4)
    runner = ModelRunner(args, default_source)
    model = runner.model
    layer = model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(proj, QuantLinear) and isinstance(proj.packed, TiledQ4Weight)
    assert isinstance(model.lm_head, QuantLinear) and isinstance(model.lm_head.packed, Q8Weight)
    assert model.lm_head.max_rows == 4
    # the head's Q8 form and its dense form (the bf16 embedding table it is tied to) nearly agree
    h = torch.randn(3, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    quant, dense = model.lm_head(h).float(), model.lm_head.big(h).float()
    assert ((quant - dense).norm() / dense.norm()).item() < 1e-2
    assert torch.equal(quant.argmax(-1), dense.argmax(-1))
