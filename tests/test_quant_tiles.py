"""Many rows against block-quantized weights that have no dense copy (csrc/cpu_quant_tiles.cpp,
`linear.DequantTilesLinear`): the blocks are a projection's only resident form.

- `dequantize` gives every block form's exact values (gguf's, rounded once to the dtype);
- the tiled products equal the dense product of those values: fp32 to the bit on this machine's
  MKL, bf16 within its rounding; each row's bf16 result is the same in any batch below the size
  where an AMX build hands the tiles to oneDNN; partial tiles and partial vectors are covered;
- a Q4_K_M-like model (Q4_K layers beside Q6_K v and down, a Q6_K head) holds no dense copy of a
  quantized matrix, and its weight bytes are the blocks' plus what has no blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from engine.kernels import cpu_extension, cpu_quant
from engine.layers.linear import DequantTilesLinear, QuantLinear, QuantParts
from engine.model_executor.model_runner import ModelRunner
from engine.models.gguf_blocks import q4k_blocks, q5_0_blocks, q5k_blocks, q6k_blocks
from tests.quant_blocks import random_q4, random_q8
from tests.test_gguf_kquants import Q4_K, Q5_0, Q5_K, Q6_K, SHAPE, kquant_bytes, write_kquant_gguf
from tests.test_model_families import family_args

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="the CPU kernels cannot be built here")

N, K = 1100, 512  # three tiles (at most 512 rows each), the last 76 rows: a partial 16-row vector
READERS = {
    "Q4_K": (q4k_blocks, Q4_K),
    "Q5_K": (q5k_blocks, Q5_K),
    "Q6_K": (q6k_blocks, Q6_K),
    "Q5_0": (q5_0_blocks, Q5_0),
}


def blocks_of(kind: str, n: int = N, k: int = K):
    if kind == "Q4_1":
        return random_q4(n, k, seed=1)
    if kind == "Q8_0":
        return random_q8(n, k, seed=2)
    reader, qtype = READERS[kind]
    return reader(kquant_bytes(qtype, n, k, np.random.default_rng(3)), (n, k))


def form_of(kind: str, dtype: torch.dtype):
    form = blocks_of(kind).pack(dtype)
    if form is None or not hasattr(form, "tiles_matmul"):
        pytest.skip(f"no block form of ours for {kind} in {dtype} on this CPU")
    return form


KINDS = ["Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K", "Q5_K"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_gives_the_files_values(kind, dtype):
    form = form_of(kind, dtype)
    expected = blocks_of(kind).dequantize().to(dtype)
    got = form.dequantize(dtype)
    assert got.shape == (N, K) and got.dtype == dtype
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_tiles_multiply_the_dense_values(kind, dtype):
    form = form_of(kind, dtype)
    w = blocks_of(kind).dequantize().to(dtype)
    g = torch.Generator().manual_seed(4)
    for rows in (1, 7, 13, 70, 200):
        x = torch.randn(rows, K, generator=g).to(dtype)
        y, ref = form.tiles_matmul(x), F.linear(x, w)
        assert y.shape == (rows, N) and y.dtype == dtype
        if dtype == torch.float32:  # the same values through MKL, tile by tile
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        else:  # bf16 outputs of fp32 sums (the lane forms sum K in their own order)
            exact = x.double() @ w.double().T
            err = (y.double() - exact).abs().max() / exact.abs().max()
            assert float(err) < 2**-7, (rows, float(err))
    # a 3-D input keeps its leading dims
    x = torch.randn(2, 3, K, generator=g).to(dtype)
    assert torch.equal(form.tiles_matmul(x), form.tiles_matmul(x.reshape(6, K)).view(2, 3, N))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tiles_run_under_inference_mode_on_every_thread(dtype):
    """The forward runs under torch.inference_mode: the tiles' threads (OpenMP workers, which do not
    inherit the mode) write the caller's inference-mode output."""
    form = form_of("Q4_K", dtype)
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(6)).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            y = form.tiles_matmul(x)
    finally:
        torch.set_num_threads(threads)
    assert y.is_inference() and torch.equal(y, form.tiles_matmul(x))


@pytest.mark.skipif(not cpu_quant.vectorized(torch.bfloat16), reason="the bf16 dot-product tiles need AVX512-BF16")
@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "Q6_K"])
def test_bf16_tiles_give_each_row_the_same_bits_in_any_batch(kind):
    """Below 64 rows the tiles run our dot-product kernel everywhere it is built: one fp32 chain
    per output over K, whatever rows sit beside it (AMX builds hand larger batches to oneDNN)."""
    form = form_of(kind, torch.bfloat16)
    x = torch.randn(13, K, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    batch = form.tiles_matmul(x)
    for i in (0, 5, 6, 12):  # around the kernel's 6-row groups
        assert torch.equal(form.tiles_matmul(x[i : i + 1]), batch[i : i + 1]), i


@pytest.mark.parametrize("n, k", [(N, K), (200, 200), (48, 70), (33, 7)])
def test_plain_bf16_weights_through_repacked_tiles(n, k):
    """`bf16_tiles_mm` (a MoE layer's stacked experts, which have no prepacked form): W's rows
    repacked per tile into VNNI pairs, 16 rows x 16 pairs at a time with the rest one by one (200 and
    70 columns leave pairs past the last 16, 48 and 33 rows a part vector): bf16 outputs of fp32
    sums of the exact products; an odd K and an fp32 x go to `F.linear` unchanged."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    module = cpu_extension.load()
    for rows in (1, 6, 7, 40, 100):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = module.bf16_tiles_mm(x, w)
        assert y.shape == (rows, n) and y.dtype == torch.bfloat16
        exact = x.double() @ w.double().T
        err = (y.double() - exact).abs().max() / exact.abs().max()
        assert float(err) < 2**-7, (rows, float(err))
        if k % 2:
            assert torch.equal(y, F.linear(x, w))
    x = torch.randn(5, k, generator=g)
    torch.testing.assert_close(module.bf16_tiles_mm(x, w), F.linear(x, w.float()))


def test_tiles_refuse_what_they_cannot_take():
    form = blocks_of("Q4_K").pack(torch.float32)
    if form is None:
        pytest.skip("no fp32 block loops on this CPU")
    t = form.tiles
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_quant.q4_tiles_mm(torch.randn(2, K - 64), t)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_quant.q4_tiles_mm(torch.randn(2, K).half(), t)
    with pytest.raises(RuntimeError, match="n_out"):
        cpu_quant.dequantize(t.codes, t.scales, t.offsets, N + 16, torch.float32)
    q8 = blocks_of("Q8_0").pack(torch.float32)
    with pytest.raises(RuntimeError, match="scales"):
        cpu_quant.q8_tiles_mm(torch.randn(2, K), q8.codes, q8.scales[:, :-1].contiguous(), None)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        cpu_quant.dequantize(q8.codes, q8.scales, None, N, torch.float16)


@pytest.mark.skipif(not cpu_quant.vectorized(torch.bfloat16), reason="bf16 K-quant blocks need AVX512-BF16 here")
def test_a_q4_k_m_model_holds_its_blocks_only(tmp_path):
    path = tmp_path / "tiny-llama-q4_k_m.gguf"
    write_kquant_gguf(path, "llama", LlamaConfig(**SHAPE), Q4_K)
    runner = ModelRunner(family_args(str(path), dtype="bfloat16", q4_max_tokens=4))
    quantized = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 4 * len(runner.model.layers) + 1  # every projection and the head
    assert all(isinstance(m.big, DequantTilesLinear) and m.big.packed is m.packed for m in quantized)
    assert any(isinstance(m.packed, QuantParts) for m in quantized)  # Q4_K q|k beside a Q6_K v
    # the weight bytes: the blocks, plus the tensors that have none (embedding, norms; a few small
    # tables held as attributes), and nothing the size of a dense copy
    others = {
        id(t): t
        for m in runner.model.modules()
        if not isinstance(m, (QuantLinear, DequantTilesLinear))
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    }
    rest = runner.weight_bytes() - sum(m.packed.nbytes for m in quantized)
    smallest_dense = min(2 * m.out_features * m.in_features for m in quantized)
    assert 0 <= rest - sum(t.numel() * t.element_size() for t in others.values()) < smallest_dense
    dense = ModelRunner(family_args(str(path), dtype="bfloat16", q4_max_tokens=0))
    quantized_dense_bytes = sum(2 * m.out_features * m.in_features for m in quantized)
    assert dense.weight_bytes() > runner.weight_bytes() + quantized_dense_bytes // 2
