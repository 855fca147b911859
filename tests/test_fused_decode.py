"""The fused C++ decode layers (engine/layers/fused_decode.py, csrc/cpu_decode_layers.cpp).

Pinned here: every fused forward's output is bit-identical to the Python layers' on the same
input and KV state (checked on each call of a real continuous batch with overlap, requests joining
and leaving: prefills, decodes below the 4-bit row bound and above it, where each projection runs
its oneDNN weight); the fused path is taken where the issue's single stream runs (the default
model in bf16 through `Engine`'s defaults) and by dense-only bf16 models (Qwen2's q|k|v biases and
Qwen3's q/k norm included, bit-identical too), and is off where it must be (the flag, the torch
backend); a projection with no dense form bounds its rows. The fp32 form: test_fused_decode_f32.py.
"""

from __future__ import annotations

import pytest
import torch

from engine import SyncScheduler
from engine.kernels import cpu_quant, cpu_vnni
from engine.layers.linear import QuantLinear
from engine.layers.q8 import Q8Weight
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs
from tests.fused_checks import check_every_fused_forward, llama_with_adapters, random_qwen

pytestmark = pytest.mark.skipif(not cpu_quant.vectorized(), reason="no AVX512-BF16 build: no fused decode layers")


def _runner(source, **kw) -> ModelRunner:
    args = dict(device="cpu", dtype="bfloat16", max_total_tokens=2048, max_running_requests=8, q4_max_tokens=4)
    return ModelRunner(ServerArgs(**(args | kw)), source)


def test_fused_forward_is_bit_identical_to_the_python_layers(default_source, default_tokenizer, monkeypatch):
    runner = _runner(default_source)
    model = runner.model
    assert model.fused_decode is not None
    rows_seen = check_every_fused_forward(monkeypatch, model)
    texts = ["The lighthouse keeper climbed", "def fibonacci(n):", "1, 2, 3,", "Dear diary, today", "Once upon"]
    prompts = [default_tokenizer.encode(t) for t in texts]
    sched = SyncScheduler(runner)
    lengths = [24, 6, 14, 30, 9]
    reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    sched.run_until_idle(overlap=True)
    assert [len(r.output_ids) for r in reqs] == lengths
    decode_rows = {rows for mode, rows in rows_seen if mode == "DECODE"}
    assert {1, 4, 5} <= decode_rows  # 4-bit up to 4 rows, oneDNN at 5; requests leave one by one
    assert any(mode == "EXTEND" and rows > 4 for mode, rows in rows_seen)  # the prefill too
    sched.scheduler.check_memory()

    plain = _runner(default_source, disable_fused_decode=True)
    assert plain.model.fused_decode is None
    sched = SyncScheduler(plain)
    again = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    sched.run_until_idle(overlap=True)
    assert [r.output_ids for r in again] == [r.output_ids for r in reqs]


def test_fused_path_only_where_it_applies(default_source):
    fp32 = _runner(default_source, dtype="float32").model.fused_decode  # the torch-op form (test_fused_decode_f32.py)
    assert fp32 is not None and not fp32.lora
    dense_only = _runner(default_source, q4_max_tokens=0).model.fused_decode  # every projection oneDNN
    assert dense_only is not None
    assert _runner(default_source, disable_fused_decode=True).model.fused_decode is None
    assert _runner(default_source, attention_backend="torch").model.fused_decode is None
    measured = _runner(default_source, q4_max_tokens=None)  # the defaults: the bound is measured
    fused = measured.model.fused_decode
    assert fused is not None and measured.q4_max_tokens >= 1


def test_the_blocks_alone_run_every_row_count_fused(default_source, monkeypatch):
    """Without a dense kernel form (no VNNI pairs nor oneDNN's prepacked form: bf16 dense weights
    stay F.linear, which the loop does not run) the block forms still take any forward: past the
    bound, their dequantized tiles."""
    import engine.layers.linear as linear

    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr(cpu_vnni, "available", lambda: False)
    model = _runner(default_source).model
    fused = model.fused_decode
    assert fused is not None
    proj = model.layers[0].mlp.down_proj
    assert isinstance(proj, linear.QuantLinear) and isinstance(proj.big, linear.DequantTilesLinear)
    assert _runner(default_source, q4_max_tokens=0).model.fused_decode is None  # nothing it can run


def test_speculative_verify_runs_fused_and_keeps_the_plain_output(default_source, default_tokenizer, monkeypatch):
    """A verify forward attends each draft position through the decode kernel (attention_cpu.
    per_token_decode_plan) and the head keeps its Q8_0 form for the verify rows, so with n-gram
    speculation the greedy output is the plain decode's, token for token; the verify forwards
    take the fused loop (bit-identical to the Python layers, checked on every call)."""
    text = "The quick brown fox jumps over the lazy dog. " * 6
    prompt = default_tokenizer.encode(text)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    rows = ServerArgs().speculative_num_draft_tokens + 1  # a verify of one request: fused up to here
    plain = SyncScheduler(_runner(default_source, q4_max_tokens=rows)).generate([prompt], params)[0].output_ids

    runner = _runner(default_source, speculative_algorithm="NGRAM", q4_max_tokens=rows)
    model = runner.model
    assert model.lm_head.max_rows >= rows  # the verify rows of one request take the decode's head
    seen = check_every_fused_forward(monkeypatch, model)
    sched = SyncScheduler(runner)
    spec = sched.generate([prompt], params)[0].output_ids
    assert spec == plain
    assert "TARGET_VERIFY" in {mode for mode, _ in seen}
    sched.scheduler.check_memory()


# Qwen2 (q|k|v biases) and Qwen3 (q/k norm): dense bf16 safetensors models of QWEN_SHAPE, so every
# projection runs its oneDNN weight in the loop.
@pytest.mark.parametrize("kind", ["qwen2-bias", "qwen3-qknorm", "qwen2-bias-int8wo"])
def test_qwen_layers_run_fused_bit_identically(kind, tmp_path, monkeypatch):
    """Qwen2's biases and Qwen3's q/k norm in the loop; with `--torchao-config int8wo` the Q8_0
    kernel runs there too (below the bound, oneDNN above)."""
    from engine.models.loader import resolve_model

    qwen2 = kind.startswith("qwen2")
    random_qwen(qwen2, tmp_path)
    source = resolve_model(str(tmp_path))
    quant = dict(torchao_config="int8wo") if kind.endswith("int8wo") else {}
    runner = _runner(source, **quant)
    model = runner.model
    attn = model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None) == qwen2
    assert (attn.qk_norm is not None) == (kind == "qwen3-qknorm")
    if quant:
        assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(attn.qkv_proj.packed, Q8Weight)
    assert model.fused_decode is not None
    seen = check_every_fused_forward(monkeypatch, model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 19, 3, 30, 12)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    fused_out = [r.output_ids for r in SyncScheduler(runner).generate(prompts, params)]
    assert {"EXTEND", "DECODE"} <= {mode for mode, _ in seen} and max(rows for _, rows in seen) >= 5

    monkeypatch.undo()
    plain = _runner(source, disable_fused_decode=True, **quant)
    assert plain.model.fused_decode is None
    assert [r.output_ids for r in SyncScheduler(plain).generate(prompts, params)] == fused_out


def test_lora_rows_run_fused_bit_identically(tmp_path, monkeypatch):
    """A batch mixing the base model and two PEFT adapters (bf16: the LoRA pool's C++ loops) stays
    in the fused loop, whose deltas after each projection are bit-identical to the Python layers'
    (prefills and decodes, adapters swapped through one slot fewer than they are)."""
    source, lora = llama_with_adapters(tmp_path)
    runner = _runner(source, **lora)
    model = runner.model
    assert runner.lora.pool.kernel == "cpu" and model.fused_decode is not None and model.fused_decode.lora
    lora_rows: list[int] = []
    seen = check_every_fused_forward(monkeypatch, model, lora_rows)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 19, 3, 30, 12, 9)]
    names = ["all", None, "rslora", "all", None, "rslora"]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)

    def run(r: ModelRunner) -> list[list[int]]:
        sched = SyncScheduler(r)
        reqs = [sched.add_request(p, params, lora_path=n) for p, n in zip(prompts, names)]
        sched.run_until_idle(overlap=True)
        sched.scheduler.check_memory()
        return [req.output_ids for req in reqs]

    fused_out = run(runner)
    with_lora = [mode for (mode, _), n in zip(seen, lora_rows) if n]
    assert {"EXTEND", "DECODE"} <= set(with_lora)
    monkeypatch.undo()
    plain = _runner(source, disable_fused_decode=True, **lora)
    assert plain.model.fused_decode is None
    assert run(plain) == fused_out
    without = _runner(source, max_loras_per_batch=1)  # the adapters change the outputs
    assert [req.output_ids for req in SyncScheduler(without).generate(prompts, params)] != fused_out
