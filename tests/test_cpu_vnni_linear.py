"""bf16 weights resident in VNNI pairs (engine/kernels/cpu_vnni.py, csrc/cpu_vnni_linear.cpp):
the layout round-trips exactly, products match fp32 references at every row count (the decode
path up to 8 rows, the tiled GEMM above), each row's bits do not depend on the batch, its
position or the thread count, and a bf16 model's dense projections load in this form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_vnni
from engine.layers.linear import BatchInvariantLinear, DenseLinear, RowTiles, VnniLinear, dense_weight, finalize_linear

pytestmark = pytest.mark.skipif(not cpu_vnni.available(), reason="needs AVX512-BF16 without AMX and the kernels built")


def _bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _dense(w: torch.Tensor, bias: torch.Tensor | None, output_sizes: tuple[int, ...] | None = None) -> DenseLinear:
    d = DenseLinear(w.shape[1], output_sizes or (w.shape[0],), bias is not None, w.device, w.dtype)
    d.weight.data.copy_(w)
    if bias is not None:
        d.bias.data.copy_(bias)
    return d


@pytest.mark.parametrize("n,k", [(1, 2), (64, 64), (100, 10), (130, 576), (3072, 256)])
def test_pack_round_trips_exactly(n, k):
    w = _bf16(n, k, seed=n + k)
    packed = cpu_vnni.pack(w)
    assert packed.shape == (-(-n // 64), k // 2, 64, 2) and packed.dtype == torch.bfloat16
    assert torch.equal(cpu_vnni.unpack(packed, n), w)
    # pair p of column c of block b is W[64 b + c, 2p : 2p + 2]; columns past N are zeros
    b, c, p = (n - 1) // 64, (n - 1) % 64, k // 2 - 1
    assert torch.equal(packed[b, p, c], w[n - 1, 2 * p : 2 * p + 2])
    assert not packed[b, :, c + 1 :].any()


@pytest.mark.parametrize("n,k", [(5, 32), (24, 64), (96, 64), (200, 130), (1000, 576), (64, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_match_an_fp32_reference_at_every_row_count(n, k, with_bias):
    w, bias = _bf16(n, k, seed=1, scale=0.05), _bf16(n, seed=2) if with_bias else None
    packed = cpu_vnni.pack(w)
    x = _bf16(70, k, seed=3)
    for rows in (1, 2, 3, 5, 6, 7, 8, 9, 13, 70):
        got = cpu_vnni.linear(x[:rows], packed, bias, n)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        want = F.linear(x[:rows].double(), w.double(), None if bias is None else bias.double())
        # one fp32 sum of exact products, rounded to bf16 once: within a bf16 ulp (plus fp32's
        # accumulation error over K terms) of the exact value
        tol = want.abs() * 2**-8 + k * 2**-22 * (x[:rows].double().abs() @ w.double().abs().T)
        assert ((got.double() - want).abs() <= tol).all(), rows


def test_a_rows_bits_do_not_depend_on_the_batch_position_or_threads():
    n, k = 330, 512
    w, bias = _bf16(n, k, seed=4, scale=0.05), _bf16(n, seed=5)
    packed = cpu_vnni.pack(w)
    x = _bf16(40, k, seed=6)
    alone = torch.cat([cpu_vnni.linear(x[i : i + 1], packed, bias, n) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for t in {1, threads}:
            torch.set_num_threads(t)
            for rows in (2, 7, 8, 9, 20, 40):
                for start in (0, 40 - rows):
                    got = cpu_vnni.linear(x[start : start + rows], packed, bias, n)
                    assert torch.equal(got, alone[start : start + rows]), (t, rows, start)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_raise_typed_errors():
    packed = cpu_vnni.pack(_bf16(70, 32, seed=7))
    with pytest.raises(RuntimeError, match="x must be bf16"):
        cpu_vnni.linear(_bf16(2, 30, seed=8), packed, None, 70)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        cpu_vnni.linear(torch.zeros(2, 32), packed, None, 70)
    with pytest.raises(RuntimeError, match="n_out"):
        cpu_vnni.linear(_bf16(2, 32, seed=8), packed, None, 200)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_vnni.linear(_bf16(2, 32, seed=8), packed, _bf16(69, seed=9), 70)
    assert cpu_vnni.linear(_bf16(0, 32, seed=8), packed, None, 70).shape == (0, 70)


def test_finalize_linear_keeps_one_vnni_form_and_reads_it_back():
    w, bias = _bf16(160, 96, seed=10, scale=0.05), _bf16(160, seed=11)
    module = finalize_linear(_dense(w, bias, (96, 32, 32)), None, 0)
    assert type(module) is VnniLinear and module.output_sizes == (96, 32, 32)
    assert torch.equal(dense_weight(module), w) and module.bias is not None
    x = _bf16(3, 4, 96, seed=12)  # leading dims are kept
    assert torch.equal(module(x), cpu_vnni.linear(x.reshape(12, 96), module.packed, module.bias, 160).view(3, 4, 160))
    # fp32 and odd widths keep their other forms
    assert type(finalize_linear(_dense(w.float(), None), None, 0)) is DenseLinear
    assert not isinstance(finalize_linear(_dense(_bf16(16, 33, seed=13), None), None, 0), VnniLinear)


def test_batch_invariant_projection_runs_the_vnni_weight_unpadded(monkeypatch):
    """Deterministic inference over a VNNI weight: no row tiles (each row is fixed already), so a
    lone row costs one pass, and every row equals itself alone in either mode."""
    w = _bf16(128, 64, seed=14, scale=0.05)
    tiles = RowTiles.for_weights(torch.bfloat16, torch.device("cpu"))
    module = finalize_linear(_dense(w, None), None, 0, tiles)
    assert isinstance(module, BatchInvariantLinear) and isinstance(module.inner, VnniLinear)
    calls: list[int] = []
    forward = VnniLinear.forward
    monkeypatch.setattr(VnniLinear, "__call__", lambda self, x: calls.append(x.shape[0]) or forward(self, x))
    x = _bf16(5, 64, seed=15)
    for decode_like in (True, False):
        tiles.select(decode_like)
        assert torch.equal(module(x)[2:3], module(x[2:3]))
    assert calls == [5, 1, 5, 1]  # never padded to the tiles' 64 or 256 rows
