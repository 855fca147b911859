"""Packed 4-bit weights (engine/layers/int4.py, linear.py) against torch's int4 kernel and the GGUF's own values.

Pinned here: the kernel's dequantization formula; GGUF Q4_1/Q4_0 blocks decode to exactly what
`gguf.quants.dequantize` gives; the q/k row un-permutation reaches the packed weights; the default
model through the packed path stays close to its dense bf16 self; and the packed path is never
taken where it must not be (threshold 0, fp32, Hugging Face folders, too many rows). bf16 outputs
differ between the int4 and dense paths, so every runner here pins `q4_max_tokens` explicitly
(the default measures the crossover at start-up).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

from engine import SyncScheduler
from engine.errors import InvalidRequestError
from engine.kernels import cpu_quant, cpu_vnni
from engine.layers import int4, linear
from engine.layers.int4 import PackedInt4Weight, Q4Blocks
from engine.layers.linear import (
    DenseLinear,
    DequantTilesLinear,
    OneDNNLinear,
    QuantLinear,
    VnniLinear,
    finalize_linear,
)
from engine.model_executor.model_runner import ModelRunner
from engine.models.gguf_blocks import q4_blocks
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req
from engine.server_args import ServerArgs
from server.cli import parse_args
from tests.sched_harness import make_tiny_llama

pytestmark = pytest.mark.skipif(not int4.int4_kernel_available(), reason="torch has no CPU int4 kernel")


def _packed_mm(x: torch.Tensor, q: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, sz)


def _close_to_matmul(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """`out` is x @ w.T up to bf16 rounding (of the output and of the kernel's scales)."""
    ref = x.float() @ w.float().T
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 8e-3, f"relative error {err:.2e}"


# ---- the kernel's contract ----------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64])
def test_kernel_formula(group):
    """W[n, k] = (q[n, k] - 8) * sz[k // G, n, 0] + sz[k // G, n, 1], groups along K, y = x @ W.T."""
    g = torch.Generator().manual_seed(0)
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=g)
    # Distinct per (group, row) values, small dyadic numbers: every W entry is exact in bf16.
    scale = torch.randint(1, 9, (k // group, n), generator=g) / 4
    zero = torch.randint(-8, 9, (k // group, n), generator=g) / 4
    sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)
    expect = (q - 8) * scale.T.repeat_interleave(group, dim=1) + zero.T.repeat_interleave(group, dim=1)
    # Rows of the identity read W back column by column.
    w_read = _packed_mm(torch.eye(k, dtype=torch.bfloat16), q, sz, group).float().T
    assert torch.equal(w_read, expect)
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    _close_to_matmul(_packed_mm(x, q, sz, group), x, expect)


def test_pack_formula_roundtrip():
    """Q4Blocks.pack_torch turns scale * q + offset into the kernel's (q - 8) * scale + zero."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (48, 128), generator=g, dtype=torch.uint8)
    scale = torch.randint(1, 9, (48, 4), generator=g) / 8
    offset = -torch.randint(0, 17, (48, 4), generator=g) / 4
    blocks = Q4Blocks(q, scale, offset, 32)
    packed = blocks.pack_torch()
    assert packed is not None and packed.scales_zeros.shape == (4, 48, 2)
    w_read = packed.matmul(torch.eye(128, dtype=torch.bfloat16)).float().T
    assert torch.equal(w_read, blocks.dequantize())


def test_pack_refuses_shapes_the_kernel_cannot_take():
    q = torch.zeros(24, 64, dtype=torch.uint8)  # 24 rows: not a multiple of 16
    assert Q4Blocks(q, torch.ones(24, 2), torch.zeros(24, 2), 32).pack_torch() is None
    q = torch.zeros(16, 64, dtype=torch.uint8)  # groups of 16: torch's kernel takes 32..256, ours 32k
    assert Q4Blocks(q, torch.ones(16, 4), torch.zeros(16, 4), 16).pack() is None


# ---- GGUF blocks ------------------------------------------------------------------------------


def _raw_tensor(source, gguf_name: str):
    """(bytes shaped as blocks, qtype, shape) of one tensor, read straight from the file."""
    info = next(t for t in source._gguf_index.tensors if t.name == gguf_name)
    raw = np.fromfile(source.gguf_file, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
    return raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype)), info.qtype, info.shape


def test_q4_1_blocks_are_the_gguf_values(default_source):
    raw, qtype, shape = _raw_tensor(default_source, "blk.3.ffn_gate.weight")
    assert qtype == GGMLQuantizationType.Q4_1
    blocks = q4_blocks(raw, qtype, shape)
    w = torch.from_numpy(np.ascontiguousarray(dequantize(raw, qtype), dtype=np.float32)).reshape(shape)
    assert torch.equal(blocks.dequantize(), w)  # fp32 scale/offset: bit-identical to gguf
    packed = blocks.pack()
    x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _close_to_matmul(packed.matmul(x), x, w)


def test_q4_0_blocks_are_the_gguf_values():
    rng = np.random.default_rng(3)
    w_src = rng.standard_normal((64, 192)).astype(np.float32)
    raw = quantize(w_src, GGMLQuantizationType.Q4_0)
    blocks = q4_blocks(raw, GGMLQuantizationType.Q4_0, (64, 192))
    w = torch.from_numpy(np.ascontiguousarray(dequantize(raw, GGMLQuantizationType.Q4_0), dtype=np.float32))
    assert torch.equal(blocks.dequantize(), w)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _close_to_matmul(blocks.pack().matmul(x), x, w)


def _first_layer(source, names: set[str], q4: bool) -> dict:
    out = {}
    for name, tensor, *extra in source.iter_weights_q4() if q4 else source.iter_weights():
        if name in names:
            out[name] = (tensor, extra[0] if extra else None)
            if len(out) == len(names):
                return out
    raise AssertionError(f"missing {names - set(out)}")


def test_q_k_rows_are_unpermuted_like_the_dense_weights(default_source):
    """The packed q/k projections compute with the dense loader's (un-permuted) rows."""
    names = {f"model.layers.0.self_attn.{p}_proj.weight" for p in ("q", "k")}
    dense = _first_layer(default_source, names, q4=False)
    packed = _first_layer(default_source, names, q4=True)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for name in names:
        w_dense = dense[name][0]
        blocks = packed[name][1]
        assert blocks is not None and torch.equal(blocks.dequantize(), w_dense)
        _close_to_matmul(blocks.pack().matmul(x), x, w_dense)
        # The file's own row order differs: the check above would catch a missed un-permutation.
        raw, qtype, shape = _raw_tensor(
            default_source, name.replace("model.layers.0.self_attn.", "blk.0.attn_").replace("_proj.weight", ".weight")
        )
        assert not torch.equal(q4_blocks(raw, qtype, shape).dequantize(), w_dense)


# ---- the model --------------------------------------------------------------------------------


def _runner(source, **kw) -> ModelRunner:
    args = dict(device="cpu", max_total_tokens=1024, max_running_requests=4)
    return ModelRunner(ServerArgs(**(args | kw)), source)


def _packed_count(runner: ModelRunner) -> int:
    """Quantized decoder-layer projections (the LM head's Q8_0 form is counted apart)."""
    return sum(isinstance(m, QuantLinear) for name, m in runner.model.named_modules() if name != "lm_head")


def _last_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    req = Req("p", ids, SamplingParams(temperature=0.0), seed=0, max_context_len=runner.context_len)
    req.init_next_round_input()
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    batch = ScheduleBatch.init_new([req], pool, alloc, None, runner.model_config.vocab_size)
    assert batch.prepare_for_extend()
    logits = runner.forward(batch.get_model_worker_batch())[0]
    alloc.free(pool.req_to_token[req.req_pool_idx, : len(ids)].to(torch.int64))
    pool.free(req.req_pool_idx)
    return logits


@pytest.fixture(scope="module")
def bf16_runners(default_source):
    """(packed for up to 64 rows: prefill of short prompts and decode both take it, dense only)."""
    return _runner(default_source, dtype="bfloat16", q4_max_tokens=64), _runner(
        default_source, dtype="bfloat16", q4_max_tokens=0
    )


def test_default_model_packs_every_layer_weight(bf16_runners):
    packed, dense = bf16_runners
    assert _packed_count(packed) == 4 * len(packed.model.layers)
    assert _packed_count(dense) == 0
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.max_rows == 64
    assert layer.self_attn.qkv_proj.packed.out_features == 576 + 2 * 192
    assert layer.mlp.gate_up_proj.packed.out_features == 2 * 1536


def test_packed_model_close_to_dense(bf16_runners, default_tokenizer):
    """Not bit-identical: the kernel's scales and zeros are bf16 (the dense weights round d*q + m to
    bf16 per weight instead) and it accumulates in another order, so logits differ at the bf16
    noise level (the same size as dense bf16 vs fp32) and a near-tie may flip a greedy token; these
    prompts have no near-ties in their first 16 tokens, and any real error (a wrong row order, a
    wrong nibble or offset) breaks all of them at once.
    """
    packed, dense = bf16_runners
    ids = default_tokenizer.encode("The lighthouse keeper climbed the spiral staircase every evening and")
    a, b = _last_logits(packed, ids), _last_logits(dense, ids)
    assert F.cosine_similarity(a, b, dim=0) > 0.999
    assert a.argmax() == b.argmax()

    prompts = [default_tokenizer.encode(p) for p in ("The capital of France is", "1, 2, 3, 4, 5,", "def fibonacci(n):")]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    outs = [[r.output_ids for r in SyncScheduler(runner).generate(prompts, params)] for runner in (packed, dense)]
    for got, ref in zip(*outs):
        first_diff = next((i for i, (u, v) in enumerate(zip(got, ref)) if u != v), len(ref))
        assert first_diff >= 12, (got, ref)


def test_int8_activations_are_asked_for(default_source, default_tokenizer):
    """--q4-int8-activations: loading the model turns the 4-bit loops' int8 x on (process-wide;
    a later load without it turns it off). The logits differ from the exact loops' at int8's
    rounding (cosine ~0.994 on this prompt, which runs the loops: 14 rows) and keep their argmax."""
    ids = default_tokenizer.encode("The lighthouse keeper climbed the spiral staircase every evening and")
    try:
        fast = _runner(default_source, dtype="bfloat16", q4_max_tokens=64, q4_int8_activations=True)
        assert cpu_quant.int8_activations() == cpu_quant.vectorized()
        b = _last_logits(fast, ids)
        exact = _runner(default_source, dtype="bfloat16", q4_max_tokens=64)
        assert not cpu_quant.int8_activations()
        a = _last_logits(exact, ids)
    finally:
        cpu_quant.set_int8_activations(False)
    if cpu_quant.vectorized():
        assert not torch.equal(a, b)
        assert F.cosine_similarity(a.float(), b.float(), dim=0) > 0.98 and a.argmax() == b.argmax()


def test_packed_path_off_where_it_must_be(default_source, tmp_path):
    assert _packed_count(_runner(default_source, dtype="bfloat16", q4_max_tokens=0)) == 0
    # fp32 takes our kernels (tests/test_cpu_quant_f32.py) where they are vectorized, else stays dense
    fp32_packed = 4 * 30 if cpu_quant.vectorized(torch.float32) else 0
    assert _packed_count(_runner(default_source, dtype="float32", q4_max_tokens=8)) == fp32_packed
    assert _packed_count(_runner(default_source, dtype="float32", q4_max_tokens=0)) == 0
    folder = make_tiny_llama(tmp_path / "tiny")  # Hugging Face folder: no 4-bit weights exist
    tiny = _runner(resolve_model(str(folder)), dtype="bfloat16", q4_max_tokens=8)
    assert _packed_count(tiny) == 0
    # The default is measured at start-up (None); an explicit value overrides it; 0 where it cannot apply.
    bf16 = {"dtype": "bfloat16"}  # dtype "auto" is float32 on a CPU without native bf16 (AVX2 only)
    cases = (
        (bf16, None),
        ({}, None),  # bf16 where the CPU has it, else fp32: both measured
        ({**bf16, "q4_max_tokens": 16}, 16),
        ({"dtype": "float32"}, None),
        ({"dtype": "float16"}, 0),
        ({"device": "cuda"}, 0),
        ({"device": "cuda", "q4_max_tokens": 16}, 0),
        ({"q4_max_tokens": 0}, 0),
    )
    for kw, rows in cases:
        assert ServerArgs(**kw).resolved_q4_max_tokens() == rows
    with pytest.raises(InvalidRequestError):
        ServerArgs(q4_max_tokens=-1).resolved_q4_max_tokens()


def _dense(w: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear:
    """A loaded DenseLinear holding `w` (and `bias`)."""
    d = DenseLinear(w.shape[1], (w.shape[0],), bias is not None, w.device, w.dtype)
    d.weight.data.copy_(w)
    if bias is not None:
        d.bias.data.copy_(bias)
    return d


def test_linear_falls_back_to_dense(monkeypatch):
    g = torch.Generator().manual_seed(6)
    blocks = Q4Blocks(
        torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8),
        torch.rand(32, 2, generator=g),
        torch.zeros(32, 2),
        32,
    )
    packed = blocks.pack()
    w, bias = blocks.dequantize().to(torch.bfloat16), torch.randn(32, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    # The int4 module, its big-batch form the plain F.linear one (its oneDNN form is pinned below).
    q4, q4_bias = QuantLinear(packed, _dense(w, None), 4), QuantLinear(packed, _dense(w, bias), 4)
    _close_to_matmul(q4(x), x, blocks.dequantize())
    torch.testing.assert_close(q4_bias(x), q4(x) + bias)

    def refuse(*_):
        raise AssertionError("packed path taken")

    monkeypatch.setattr(PackedInt4Weight, "matmul", refuse)
    for inp in (torch.randn(5, 64, generator=g).to(torch.bfloat16), x[:0]):  # rows > 4, empty
        assert torch.equal(q4_bias(inp), F.linear(inp, w, bias))
    # torch's int4pack form (fp16-inexact scales: not ours) takes bf16 only: an fp32 model keeps the
    # dense weight (a few rows through the fp32 small-batch loop, test_cpu_gemv.py; more through
    # F.linear itself). Our tiled form does take fp32 (tests/test_cpu_quant_f32.py).
    assert isinstance(packed, PackedInt4Weight)
    fp32 = finalize_linear(_dense(w.float(), bias.float()), packed, 4)
    assert type(fp32) is DenseLinear
    torch.testing.assert_close(fp32(x.float()), F.linear(x.float(), w.float(), bias.float()))
    many = torch.randn(64, 64, generator=g)
    assert torch.equal(fp32(many), F.linear(many, w.float(), bias.float()))
    assert type(finalize_linear(_dense(w, bias), packed, 0)) is not QuantLinear  # threshold 0: no int4 form


def test_cli_flag():
    assert parse_args(["--q4-max-tokens", "0"])[0]["q4_max_tokens"] == 0
    assert "q4_max_tokens" not in parse_args([])[0]
    assert parse_args(["--q4-int8-activations"])[0]["q4_int8_activations"] is True
    assert "q4_int8_activations" not in parse_args([])[0] and ServerArgs().q4_int8_activations is False
    with pytest.raises(SystemExit):
        parse_args(["--q4-max-tokens", "-1"])


@pytest.mark.skipif(not linear.onednn_bf16_available(), reason="no oneDNN bf16 in this torch build or on this CPU")
def test_onednn_prepacked_weight_is_bit_identical_to_f_linear():
    """Prepacking only moves the reorder out of the call: same oneDNN kernel, same bits, for any
    row count (decode batches and prefills), with and without bias, and for the LM head shape."""
    g = torch.Generator().manual_seed(7)
    for out_f, in_f in ((960, 576), (576, 1536), (4096, 576)):
        w = torch.randn(out_f, in_f, generator=g).to(torch.bfloat16)
        bias = torch.randn(out_f, generator=g).to(torch.bfloat16)
        dnn, dnn_bias = OneDNNLinear.from_dense(_dense(w, None)), OneDNNLinear.from_dense(_dense(w, bias))
        assert dnn is not None and dnn_bias is not None
        for rows in (1, 5, 32, 300):
            x = torch.randn(rows, in_f, generator=g).to(torch.bfloat16)
            assert torch.equal(dnn(x), F.linear(x, w))
            assert torch.equal(dnn_bias(x), F.linear(x, w, bias))
    assert OneDNNLinear.from_dense(_dense(torch.randn(32, 64), None)) is None  # fp32 keeps F.linear (the reference)


@pytest.mark.skipif(not linear.onednn_bf16_available(), reason="no oneDNN bf16 in this torch build or on this CPU")
def test_runner_prepacks_only_in_bf16(bf16_runners, default_source):
    packed, dense = bf16_runners
    layer = packed.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    # our block forms are the only resident form (many rows: their dequantized tiles); torch's
    # int4pack form keeps the prepacked dense form beside it
    big = DequantTilesLinear if cpu_quant.vectorized() else OneDNNLinear
    assert all(isinstance(p, QuantLinear) and isinstance(p.big, big) for p in projections)
    # the tied Q8_0 head (our kernel) beside the embedding table itself (no copy), or prepacked alone
    head = packed.model.lm_head
    if isinstance(head, QuantLinear):
        assert type(head.big) is DenseLinear and head.big.weight is packed.model.embed_tokens.weight
    else:
        assert isinstance(head, OneDNNLinear)
    assert isinstance(head, QuantLinear) == cpu_quant.vectorized()
    dense_form = VnniLinear if cpu_vnni.available() else OneDNNLinear  # q4_max_tokens=0: no quantized form
    assert isinstance(dense.model.lm_head, dense_form)
    assert isinstance(dense.model.layers[0].mlp.down_proj, dense_form)
    fp32 = _runner(default_source, dtype="float32", q4_max_tokens=0)
    assert type(fp32.model.layers[0].self_attn.qkv_proj) is DenseLinear and type(fp32.model.lm_head) is DenseLinear
