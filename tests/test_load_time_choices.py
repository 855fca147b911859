"""Implementations are chosen once, when the model loads, from the device, dtype and machine.

For each configuration: which linear form every projection gets (dense `F.linear`, oneDNN
prepacked, int4 with a dense form for big inputs), whether the norms, the activation and rotary
run the fused C++ ops or the torch ops, and which attention backend runs. Also: dense weights no
path reads after packing are really freed (a tied LM head keeps the embedding table), and the
int4 row bound is measured at start-up unless given.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.kernels import cpu_quant, cpu_vnni
from engine.layers import int4_crossover
from engine.layers.activation import SiluAndMul
from engine.layers.int4 import TiledQ4Weight, int4_kernel_available
from engine.layers.linear import (
    DenseLinear,
    DequantTilesLinear,
    OneDNNLinear,
    QuantLinear,
    VnniLinear,
    onednn_bf16_available,
)
from engine.layers.norm import AddRMSNorm, RMSNorm
from engine.model_config import ModelConfig
from engine.model_executor.model_runner import ModelRunner
from engine.models import llama
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import resolve_model
from engine.server_args import ServerArgs
from tests.sched_harness import make_tiny_llama

CPU = torch.device("cpu")
needs_fast_paths = pytest.mark.skipif(
    not (int4_kernel_available() and onednn_bf16_available()), reason="no int4 or oneDNN bf16 ops here"
)


def _runner(source, **kw) -> ModelRunner:
    args = dict(device="cpu", max_total_tokens=256, max_running_requests=4) | kw
    return ModelRunner(ServerArgs(**args), source)


def _projections(model: LlamaForCausalLM) -> list[torch.nn.Module]:
    return [
        m
        for layer in model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def _elementwise(model: LlamaForCausalLM) -> list[torch.nn.Module]:
    """Every module that has a fused form: norms, the activation, rotary."""
    ops: list[torch.nn.Module] = [model.norm, model.rotary_emb]
    for layer in model.layers:
        ops += [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.act_fn]
    return ops


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_fp32_is_the_reference_path(default_source):
    """fp32: dense weights (F.linear, or our fp32 loop for a few rows) and torch elementwise ops
    (transformers parity); attention in the C++ kernels (head size 64). A GGUF's 4-bit layers and
    Q8_0 head keep their blocks where our fp32 loops are vectorized (the file's exact values:
    tests/test_cpu_quant_f32.py), few rows in those loops, more through their dequantized tiles."""
    runner = _runner(default_source, dtype="float32", q4_max_tokens=0)
    model = runner.model
    assert all(type(p) is DenseLinear for p in _projections(model)) and type(model.lm_head) is DenseLinear
    assert not any(op.uses_cpu_kernel for op in _elementwise(model)) and not model.fused
    assert runner.attn_backend_name == "cpu" and runner.q4_max_tokens == 0
    quant = _runner(default_source, dtype="float32", q4_max_tokens=4).model
    if cpu_quant.vectorized(torch.float32):
        forms = [*_projections(quant), quant.lm_head]
        # the blocks only: more rows run their tiles dequantized to fp32 (MKL); the tied head beside
        # the embedding table it shares
        assert all(type(p) is QuantLinear and p.max_rows == 4 for p in forms)
        assert all(type(p.big) is DequantTilesLinear and p.big.dtype == torch.float32 for p in forms[:-1])
        assert type(quant.lm_head.big) is DenseLinear and quant.lm_head.big.weight is quant.embed_tokens.weight
    else:
        assert all(type(p) is DenseLinear for p in _projections(quant))


@needs_fast_paths
def test_cpu_bf16_with_kernels_gets_onednn_int4_and_fused_ops(default_source):
    runner = _runner(default_source, dtype="bfloat16", q4_max_tokens=16)
    model = runner.model
    projections = _projections(model)
    # our 4-bit tiles alone (more rows: their dequantized tiles); torch's int4pack beside oneDNN's form
    big = DequantTilesLinear if cpu_quant.vectorized() else OneDNNLinear
    assert all(isinstance(p, QuantLinear) and isinstance(p.big, big) for p in projections)
    assert all(p.max_rows == 16 for p in projections) and runner.q4_max_tokens == 16
    head = model.lm_head  # the tied head: never 4-bit; its Q8_0 form beside the embedding table, else prepacked
    if isinstance(head, QuantLinear):
        assert type(head.big) is DenseLinear and head.big.weight is model.embed_tokens.weight
    else:
        assert isinstance(head, OneDNNLinear)
    assert isinstance(head, QuantLinear) == cpu_quant.vectorized() and getattr(head, "max_rows", 16) == 16
    ops = _elementwise(model)
    assert all(op.uses_cpu_kernel for op in ops) and model.fused
    assert {type(op) for op in ops} >= {RMSNorm, AddRMSNorm, SiluAndMul}
    assert runner.attn_backend_name == "cpu"


@needs_fast_paths
def test_kernels_off_keeps_torch_ops(default_source, monkeypatch):
    """ASYNCLLM_CPU_KERNELS=0: torch elementwise ops and the torch attention backend; the linears
    are torch's own ops (oneDNN, int4), so they keep their fast forms."""
    monkeypatch.setenv("ASYNCLLM_CPU_KERNELS", "0")
    runner = _runner(default_source, dtype="bfloat16", q4_max_tokens=16)
    assert not any(op.uses_cpu_kernel for op in _elementwise(runner.model)) and not runner.model.fused
    assert runner.attn_backend_name == "torch"
    assert all(isinstance(p, QuantLinear) for p in _projections(runner.model))


@needs_fast_paths
def test_hf_folder_bf16_has_no_int4_form(tiny_folder):
    """No 4-bit weights in a Hugging Face folder: dense forms only (VNNI pairs on AVX512-BF16 without
    AMX, else oneDNN's); head size 16: torch attention, hidden size 64: fused norms."""
    runner = _runner(resolve_model(str(tiny_folder)), dtype="bfloat16", q4_max_tokens=16)
    dense = VnniLinear if cpu_vnni.available() else OneDNNLinear
    assert all(type(p) is dense for p in _projections(runner.model))
    assert runner.attn_backend_name == "torch" and runner.model.norm.uses_cpu_kernel


@needs_fast_paths
def test_q4_rows_are_measured_unless_given(default_source, monkeypatch):
    runner = _runner(default_source, dtype="bfloat16")
    rows = runner.q4_max_tokens
    assert 0 <= rows <= int4_crossover.CANDIDATE_ROWS[-1] or rows == int4_crossover.ALL_ROWS
    int4 = [p for p in _projections(runner.model) if isinstance(p, QuantLinear)]
    assert all(p.max_rows == rows for p in int4) and len(int4) == len(_projections(runner.model))
    # A machine where the small-batch loops never win: our blocks stay the only form, every row
    # count through their dequantized tiles; torch's int4pack form is dropped for the dense one.
    monkeypatch.setattr(llama, "measure_int4_crossover", lambda linears, dtype=None: 0)
    runner = _runner(default_source, dtype="bfloat16")
    assert runner.q4_max_tokens == 0
    if cpu_quant.vectorized():
        forms = _projections(runner.model)
        assert all(type(p) is QuantLinear and p.max_rows == 0 and type(p.big) is DequantTilesLinear for p in forms)
    else:
        assert all(type(p) is OneDNNLinear for p in _projections(runner.model))


@needs_fast_paths
def test_crossover_measurement_is_cached_and_bounded(default_source):
    runner = _runner(default_source, dtype="bfloat16", q4_max_tokens=64)
    int4 = [p for p in _projections(runner.model) if isinstance(p, QuantLinear)]
    first = int4_crossover.measure_int4_crossover(int4)
    assert 0 <= first <= int4_crossover.CANDIDATE_ROWS[-1] or first == int4_crossover.ALL_ROWS
    timed = int4_crossover.cold_cache_prefix(int4)
    llc = int4_crossover.last_level_cache_bytes()
    timed_bytes = sum(2 * p.in_features * p.out_features for p in timed)
    assert timed_bytes >= 2 * llc or len(timed) == len(int4)  # the weights cannot all sit in the cache
    assert int4_crossover.measure_int4_crossover(int4) == first  # cached: the same shapes, threads


@needs_fast_paths
def test_a_prefill_sized_point_decides_every_row_count(default_source, monkeypatch):
    """With --q4-int8-activations, bf16 4-bit loops that still win at the last row count timed get
    one more point, at PREFILL_ROWS on the first PREFILL_WEIGHTS parameters, timed hot: winning
    there, they run every row count; losing, the bound stays. A measured loss, the Q8_0 head and
    the exact loops (the default) skip the point."""
    runner = _runner(default_source, dtype="bfloat16", q4_max_tokens=64)
    int4 = [p for p in _projections(runner.model) if isinstance(p, QuantLinear)]
    seen: list[tuple[int, int, bool]] = []
    monkeypatch.setattr(cpu_quant, "int8_activations", lambda: True)

    def best_times(a, b, evict):
        seen.append((len(a[0]), a[1][0].shape[0], evict is None))
        return 1.0, 2.0  # the quantized side twice as fast at every point

    monkeypatch.setattr(int4_crossover, "_best_times", best_times)
    monkeypatch.setattr(int4_crossover, "BUDGET_S", 0.0)
    for wins, expect in ((True, int4_crossover.ALL_ROWS), (False, int4_crossover.MIN_ROWS)):
        monkeypatch.setattr(int4_crossover, "_cache", {})
        monkeypatch.setattr(int4_crossover, "PREFILL_WIN", 0.4 if wins else 0.6)
        seen.clear()
        assert int4_crossover.measure_int4_crossover(int4) == expect
        n, rows, hot = seen[-1]  # the prefill point: hot, on the first projections holding the weights
        assert rows == int4_crossover.PREFILL_ROWS and hot
        weights = [p.in_features * p.out_features for p in int4[:n]]
        assert sum(weights) >= int4_crossover.PREFILL_WEIGHTS > sum(weights[:-1])
    # a loss at the first point: bounded (0 here), no prefill point
    monkeypatch.setattr(int4_crossover, "_cache", {})
    monkeypatch.setattr(int4_crossover, "_best_times", lambda a, b, evict: seen.append(a[1][0].shape[0]) or (2.0, 1.0))
    seen.clear()
    assert int4_crossover.measure_int4_crossover(int4) == 0 and seen == [1]
    head = runner.model.lm_head
    assert isinstance(head, QuantLinear) and not isinstance(head.packed, TiledQ4Weight)
    monkeypatch.setattr(int4_crossover, "_best_times", best_times)
    seen.clear()
    assert int4_crossover.measure_int4_crossover([head]) == int4_crossover.MIN_ROWS
    assert all(rows != int4_crossover.PREFILL_ROWS for _, rows, _ in seen)
    monkeypatch.setattr(cpu_quant, "int8_activations", lambda: False)
    monkeypatch.setattr(int4_crossover, "_cache", {})
    seen.clear()
    assert int4_crossover.measure_int4_crossover(int4) == int4_crossover.MIN_ROWS
    assert all(rows != int4_crossover.PREFILL_ROWS for _, rows, _ in seen)
    # every row count through the loops: a prefill-sized input runs them, not the tiles
    x = torch.randn(300, int4[0].in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    int4[0].max_rows = int4_crossover.ALL_ROWS
    assert torch.equal(int4[0](x), int4[0].packed.matmul(x))


@needs_fast_paths
def test_crossover_of_cache_sized_projections_is_timed_cold(default_source, monkeypatch):
    """Projections smaller than twice the last-level cache (the LM head, measured alone) are timed
    after a read of an eviction buffer: timed hot, the dense head beat the Q8_0 kernel from 3 rows
    while inside decode steps the Q8_0 head was faster up to 4."""
    runner = _runner(default_source, dtype="bfloat16", q4_max_tokens=64)
    small = [p for p in _projections(runner.model) if isinstance(p, QuantLinear)][:2]
    reads: list[int] = []
    monkeypatch.setattr(int4_crossover, "_cache", {})
    monkeypatch.setattr(int4_crossover, "_evict", lambda buf: reads.append(0 if buf is None else buf.nbytes))
    int4_crossover.measure_int4_crossover(small)
    timed = [n for n in reads if n]
    assert timed and len(timed) % (2 * int4_crossover.REPEATS) == 0  # before every timed pass of each side
    assert min(timed) >= 2 * int4_crossover.last_level_cache_bytes()


def _load(source, dtype: torch.dtype, with_q4: bool) -> tuple[LlamaForCausalLM, dict]:
    cfg = ModelConfig.from_hf(source.hf_config, source.architecture)
    model = LlamaForCausalLM(cfg, source.hf_config, CPU, dtype)
    weights = source.iter_weights_q4() if with_q4 else ((n, t, None) for n, t in source.iter_weights())
    return model, model.load_weights(weights)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@needs_fast_paths
@pytest.mark.parametrize("with_q4", [True, False], ids=["int4+onednn", "onednn"])
def test_dense_weights_nobody_reads_are_freed(default_source, with_q4):
    model, q4 = _load(default_source, torch.bfloat16, with_q4)
    dense = [weakref.ref(p.weight) for p in _projections(model)]
    embed = model.embed_tokens.weight
    assert model.lm_head.weight is embed  # tied: the head reads the embedding table
    before = _param_bytes(model)
    model.process_weights_after_loading(q4, 8 if with_q4 else 0)
    gc.collect()
    assert all(ref() is None for ref in dense), "a dense projection weight outlived its packed form"
    assert model.embed_tokens.weight is embed  # still there for the lookup
    assert before - _param_bytes(model) == sum(2 * p.in_features * p.out_features for p in _projections(model))


@needs_fast_paths
def test_untied_head_weight_is_freed(tiny_folder):
    model, q4 = _load(resolve_model(str(tiny_folder)), torch.bfloat16, False)
    head = weakref.ref(model.lm_head.weight)
    assert head() is not model.embed_tokens.weight
    model.process_weights_after_loading(q4, 0)
    gc.collect()
    assert head() is None and isinstance(model.lm_head, VnniLinear if cpu_vnni.available() else OneDNNLinear)


def test_fp32_keeps_its_dense_weights(tiny_folder):
    model, q4 = _load(resolve_model(str(tiny_folder)), torch.float32, False)
    weights = [p.weight for p in _projections(model)]
    model.process_weights_after_loading(q4, 0)
    assert all(p.weight is w for p, w in zip(_projections(model), weights, strict=True))
