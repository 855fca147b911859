"""The fused bf16 elementwise kernels (engine/kernels/csrc/cpu_elementwise.cpp) against torch.

They follow transformers' bf16 op order (so results agree with torch's op-by-op computation up to
one bf16 rounding step where an fp32 sum lands near a rounding boundary), update the residual in
place, and reject what they cannot take. End to end, the bf16 engine with them on must produce
the same greedy tokens as with them off (ASYNCLLM_CPU_KERNELS=0 keeps the torch ops).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_elementwise as fused
from engine.layers.norm import rms_norm, rms_norm_unit_offset


@pytest.fixture(scope="module", autouse=True)
def built():
    assert fused.load() is not None, "the CPU kernels did not build (see the log)"


def _bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 representable steps apart a and b are, per element (same sign assumed)."""
    ai, bi = a.view(torch.int16).int(), b.view(torch.int16).int()
    return (ai - bi).abs()


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """At most one bf16 step apart, rarely that; values both below 1e-30 count as equal (the kernel's
    exp flushes results under ~1e-38 to 0 where torch keeps fp32 denormals)."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    steps = _bf16_steps(out, ref)
    steps[(out.float().abs() < 1e-30) & (ref.float().abs() < 1e-30)] = 0
    assert int(steps.max()) <= 1, f"off by {int(steps.max())} bf16 steps"
    assert float((steps > 0).float().mean()) < 0.01  # and only rarely off at all


@pytest.mark.parametrize("rows,width", [(1, 64), (7, 576), (300, 576), (33, 1024)])
def test_rms_norm_matches_transformers_bf16_op_order(rows, width):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    w = (torch.rand(width, generator=gen) + 0.5).bfloat16()
    _close(fused.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


def test_add_rms_norm_updates_the_residual_in_place():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(50, 576, generator=gen).bfloat16()
    y = torch.randn(50, 576, generator=gen).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    summed = x + y  # torch's bf16 add: the one rounding the kernel must reproduce exactly
    ref = rms_norm(summed, w, 1e-6)
    before = x.data_ptr()
    h = fused.add_rms_norm_(x, y, w, 1e-6)
    assert x.data_ptr() == before and torch.equal(x, summed)
    _close(h, ref)


@pytest.mark.parametrize("rows", [1, 5, 129])
def test_silu_mul_matches_torch(rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 88.5, -88.5]).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused.silu_mul(gate_up)
    _close(out, F.silu(gate) * up)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("rows,width", [(1, 64), (7, 2304), (300, 576)])
def test_gemma_norm_matches_its_torch_form(rows, width):
    """Gemma's (1 + w) RMSNorm: the scale in fp32 before the one rounding."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    w = (torch.rand(width, generator=gen) - 0.5).bfloat16()  # offsets from 1
    _close(fused.rms_norm_unit_offset(x, w, 1e-6), rms_norm_unit_offset(x, w, 1e-6))


@pytest.mark.parametrize("unit_offset", [False, True])
def test_per_head_norm_is_each_heads_row_norm(unit_offset):
    """Qwen3's (Gemma 3's) q/k norm on the q|k slab of a fused projection: every head is the row
    norm of that head with its own weight row, bit for bit, whatever the token stride; within one
    bf16 step of the torch forms the Python layers ran before."""
    g = torch.Generator().manual_seed(11)
    t, heads, kv_heads, d = 9, 6, 2, 64
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * d, generator=g) * 3).to(torch.bfloat16)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)  # token stride past the slab
    assert not qk.is_contiguous()
    q_w, k_w = (
        (torch.randn(d, generator=g) * 0.5).to(torch.bfloat16),
        (torch.randn(d, generator=g) * 0.5).to(torch.bfloat16),
    )
    table = torch.cat([q_w.expand(heads, -1), k_w.expand(kv_heads, -1)])
    out = fused.rms_norm_heads(qk, table, 1e-6, unit_offset)
    assert out.shape == qk.shape and out.is_contiguous()
    row_norm = fused.rms_norm_unit_offset if unit_offset else fused.rms_norm
    for h in range(heads + kv_heads):
        assert torch.equal(out[:, h], row_norm(qk[:, h].contiguous(), table[h].contiguous(), 1e-6))
    torch_form = rms_norm_unit_offset if unit_offset else rms_norm
    _close(out, torch_form(qk, table, 1e-6))
    with pytest.raises(RuntimeError, match="table"):
        fused.rms_norm_heads(qk, table[:-1].contiguous(), 1e-6)


def test_gemma_sandwich_step_sums_in_place_then_normalises():
    """x += post_norm(y) in place (the norm rounded to bf16, then the sum: torch's two ops), then
    the next norm of the sum; without a next weight, x itself comes back."""
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(40, 2304, generator=gen) * 2).bfloat16()
    y = (torch.randn(40, 2304, generator=gen) * 5).bfloat16()
    w_post, w_next = ((torch.rand(2304, generator=gen) - 0.5).bfloat16() for _ in range(2))
    normed_y = fused.rms_norm_unit_offset(y, w_post, 1e-6)
    summed = x + normed_y
    before = x.data_ptr()
    out = fused.add_unit_norm_(x, y, w_post, w_next, 1e-6)
    assert x.data_ptr() == before and torch.equal(x, summed)
    assert torch.equal(out, fused.rms_norm_unit_offset(summed, w_next, 1e-6))
    _close(out, rms_norm_unit_offset(summed, w_next, 1e-6))
    again = fused.add_unit_norm_(x, y, w_post, None, 1e-6)
    assert again.data_ptr() == before and torch.equal(x, summed + normed_y)


@pytest.mark.parametrize("rows", [1, 5, 129])
def test_gelu_tanh_mul_matches_torch(rows):
    """Gemma's GeGLU, gelu(gate, approximate="tanh") * up, across tanh's two branches and its tails."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).bfloat16()
    gate_up[0, :10] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 0.5, -0.5, 1.1, -1.1]).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    out = fused.gelu_tanh_mul(gate_up)
    # torch's op order (gelu rounded to bf16, then the product) on the function itself, as
    # g * sigmoid(2y) = 0.5 g (1 + tanh(y)) in fp64: torch's own fp32 form (and fp64's, further
    # out) loses every digit of 1 + tanh(y) for gate below ~-4 (results under ~1e-6)
    g = gate.double()
    exact = g * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3))
    _close(out, exact.bfloat16() * up)
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, atol=1e-5, rtol=1e-2)
    assert torch.isfinite(out).all()


def test_bad_inputs_raise_not_crash():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    bad_norms = [
        (x.float(), w.float()),  # fp32 stays on the torch ops
        (torch.zeros(4, 60, dtype=torch.bfloat16), torch.ones(60, dtype=torch.bfloat16)),  # not a multiple of 16
        (x, torch.ones(32, dtype=torch.bfloat16)),  # weight of the wrong size
        (torch.zeros(2, 4, 64, dtype=torch.bfloat16), w),  # not [T, N]
    ]
    for xx, ww in bad_norms:
        with pytest.raises(RuntimeError):
            fused.rms_norm(xx, ww, 1e-6)
        with pytest.raises(RuntimeError):
            fused.rms_norm_unit_offset(xx, ww, 1e-6)
        with pytest.raises(RuntimeError):  # as the post-norm's weight, or as the next norm's
            fused.add_unit_norm_(xx.clone(), xx, ww, None, 1e-6)
        with pytest.raises(RuntimeError):
            fused.add_unit_norm_(xx.clone(), xx, ww if xx is not x else w, ww, 1e-6)
    with pytest.raises(RuntimeError):
        fused.add_unit_norm_(x, torch.zeros(3, 64, dtype=torch.bfloat16), w, None, 1e-6)
    with pytest.raises(RuntimeError):
        fused.gelu_tanh_mul(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        fused.add_rms_norm_(x, torch.zeros(3, 64, dtype=torch.bfloat16), w, 1e-6)
    with pytest.raises(RuntimeError):
        fused.silu_mul(torch.zeros(2, 48, dtype=torch.bfloat16))  # I = 24: not a multiple of 16
    assert fused.supports(x) and not fused.supports(x.float())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_is_bit_identical_to_torch(head_dim):
    from engine.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(head_dim)
    t, heads, kv_heads = 37, 9, 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).bfloat16()
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)  # strided rows, as in the model
    ang = torch.rand(t, head_dim, generator=gen) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    out = fused.rotary(qk, cos, sin)
    assert out.is_contiguous() and torch.equal(out, apply_rotary(qk, cos, sin))
    with pytest.raises(RuntimeError):
        fused.rotary(qk.float(), cos.float(), sin.float())
    with pytest.raises(RuntimeError):
        fused.rotary(qk, cos[:5], sin[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_rows_gives_torchs_indices(dtype):
    """The greedy sampler's argmax (csrc/cpu_argmax.cpp) against torch.argmax: widths with and
    without a vector tail, narrower than a vector, ties (the first index wins), rows of -inf, NaN
    (torch reports the first NaN), and the batch of a decode step."""
    gen = torch.Generator().manual_seed(3)
    for rows, width in [(1, 49152), (64, 49152), (3, 15), (5, 16), (7, 33), (2, 1), (4, 1000)]:
        x = torch.randn(rows, width, generator=gen).to(dtype)
        assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1)), (rows, width)
    x = torch.randn(6, 1000, generator=gen).to(dtype)
    x[0, 10] = x[0, 700] = x[0, 999] = 50.0  # a tie across vector lanes and the tail
    x[1, 5], x[1, 900] = float("nan"), float("nan")
    x[2] = float("-inf")
    x[3, 997] = float("nan")  # in the tail only
    x[4, :16] = 1e4  # a tie inside the first vector
    x[5, 999] = 1e4  # the maximum is the last element
    assert fused.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [10, 5, 0, 997, 0, 999]
    assert torch.equal(fused.argmax_rows(x[:, :15].contiguous()), x[:, :15].argmax(dim=-1))
    with pytest.raises(RuntimeError):
        fused.argmax_rows(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError):
        fused.argmax_rows(torch.zeros(8, 2)[:, :1])  # not contiguous
