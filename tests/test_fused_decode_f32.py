"""The fused C++ decode loop in fp32 (engine/layers/fused_decode.py, csrc/cpu_decode_layers.cpp).

fp32 is the transformers parity path and what `dtype auto` gives on a CPU without bf16
arithmetic. The loop calls, from C++, the torch ops the Python layers run between the projections
and each projection in the form its module picks for the row count, so every fused forward must
be bit-identical to the Python layers on the same input and KV state (checked on each call of real
continuous batches: prefills, decodes on the block-quantized loops, on cpu_gemv's few-row loop and
on `F.linear` above it), for Qwen2's biases and Qwen3's q/k norm too, for deterministic
inference's fixed-order groups, for a speculative verify and for LoRA adapter rows. Greedy tokens
stay transformers'.
"""

from __future__ import annotations

import pytest
import torch

from engine import SyncScheduler
from engine.kernels import cpu_extension, cpu_quant
from engine.layers.linear import BatchInvariantLinear, DenseLinear, QuantLinear
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs
from tests.fused_checks import check_every_fused_forward, llama_with_adapters, random_qwen

pytestmark = pytest.mark.skipif(cpu_extension.load() is None, reason="CPU kernels not built: no fused decode loop")


def _runner(source, **kw) -> ModelRunner:
    args = dict(device="cpu", dtype="float32", max_total_tokens=4096, max_running_requests=12, q4_max_tokens=4)
    return ModelRunner(ServerArgs(**(args | kw)), source)


def _run(
    runner: ModelRunner, prompts: list[list[int]], lengths: list[int], adapters: list[str | None] | None = None
) -> list[list[int]]:
    sched = SyncScheduler(runner)
    adapters = adapters or [None] * len(prompts)
    reqs = [
        sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True), lora_path=a)
        for p, n, a in zip(prompts, lengths, adapters)
    ]
    sched.run_until_idle(overlap=True)
    sched.scheduler.check_memory()
    return [r.output_ids for r in reqs]


@pytest.mark.parametrize("q4_max_tokens", [4, 0], ids=["blocks", "dense"])
def test_fp32_fused_forwards_are_bit_identical_to_the_python_layers(
    q4_max_tokens, default_source, default_tokenizer, monkeypatch
):
    """Ten requests of different lengths leave one by one: decodes of 10 rows down to 1 cross each
    projection form's bound (the GGUF's fp32 block loops up to 4 rows, or none; cpu_gemv up to 8;
    `F.linear` above), and the prefill runs in the loop too."""
    runner = _runner(default_source, q4_max_tokens=q4_max_tokens)
    model = runner.model
    fused = model.fused_decode
    assert fused is not None and not fused.tiled
    qkv = model.layers[0].self_attn.qkv_proj
    blocks = q4_max_tokens > 0 and cpu_quant.vectorized(torch.float32)
    assert isinstance(qkv, QuantLinear) == blocks and (isinstance(qkv, DenseLinear) or blocks)
    seen = check_every_fused_forward(monkeypatch, model)
    texts = ["The lighthouse keeper", "def fibonacci(n):", "1, 2, 3,", "Dear diary, today", "Once upon", "SELECT"]
    prompts = [default_tokenizer.encode(t) for t in texts] + [[17 + i, 400 + 9 * i, 1000 + i] for i in range(4)]
    lengths = [3, 5, 7, 9, 11, 13, 15, 17, 19, 21]
    out = _run(runner, prompts, lengths)
    assert [len(o) for o in out] == lengths
    decode_rows = {rows for mode, rows in seen if mode == "DECODE"}
    assert {1, 4, 5, 8, 9, 10} <= decode_rows
    assert any(mode == "EXTEND" and rows > 8 for mode, rows in seen)

    monkeypatch.undo()
    plain = _runner(default_source, q4_max_tokens=q4_max_tokens, disable_fused_decode=True)
    assert plain.model.fused_decode is None
    assert _run(plain, prompts, lengths) == out


@pytest.mark.parametrize("kind", ["qwen2-bias", "qwen3-qknorm"])
def test_qwen_layers_run_fused_in_fp32_with_transformers_tokens(kind, tmp_path, monkeypatch):
    """Qwen2's q|k|v biases and Qwen3's q/k norm in the fp32 loop: bit-identical to the Python
    layers on every call, and the greedy tokens are transformers' own."""
    from engine.models.loader import resolve_model

    hf = random_qwen(kind == "qwen2-bias", tmp_path)
    runner = _runner(resolve_model(str(tmp_path)))
    assert runner.model.fused_decode is not None
    seen = check_every_fused_forward(monkeypatch, runner.model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 19, 3, 30, 12, 5, 9, 14, 21, 2)]
    out = _run(runner, prompts, [12] * len(prompts))
    assert {"EXTEND", "DECODE"} <= {mode for mode, _ in seen} and max(rows for mode, rows in seen) >= 9
    with torch.no_grad():
        for prompt, ours in zip(prompts, out):
            ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert ids[0, len(prompt) :].tolist() == ours


def test_deterministic_fp32_decodes_run_the_loop_in_fixed_groups(default_source, default_tokenizer, monkeypatch):
    """`--enable-deterministic-inference` in fp32: decode forwards take the loop, each projection
    on the GGUF's block loops at any row count where this CPU has them (else cpu_gemv's
    fixed-order loop in groups of 8 rows, as `gemv_groups`); extends keep the Python layers'
    padded tiles. Bit-identical to the Python layers on every call."""
    runner = _runner(default_source, enable_deterministic_inference=True, q4_max_tokens=None)
    model = runner.model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, BatchInvariantLinear)
    assert (down.blocks is not None) == cpu_quant.vectorized(torch.float32)
    fused = model.fused_decode
    assert fused is not None and fused.tiled
    seen = check_every_fused_forward(monkeypatch, model)
    prompts = [default_tokenizer.encode(t) for t in ("Once upon a time", "The sea", "Hello")]
    prompts += [[30 + i, 700 + i] for i in range(7)]
    out = _run(runner, prompts, [4, 6, 8, 10, 12, 14, 16, 18, 20, 22])
    modes = {mode for mode, _ in seen}
    assert modes == {"DECODE"} and max(rows for _, rows in seen) == 10  # groups of 8 and 2

    monkeypatch.undo()
    plain = _runner(default_source, enable_deterministic_inference=True, q4_max_tokens=None, disable_fused_decode=True)
    assert _run(plain, prompts, [4, 6, 8, 10, 12, 14, 16, 18, 20, 22]) == out


def test_fp32_speculative_verify_runs_fused_and_keeps_the_plain_output(default_source, default_tokenizer, monkeypatch):
    """An n-gram verify (one decode query per draft position through the kernel) takes the fp32
    loop, bit-identical to the Python layers, and speculation keeps the plain greedy tokens."""
    prompt = default_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
    plain = _run(_runner(default_source), [prompt], [40])
    runner = _runner(default_source, speculative_algorithm="NGRAM")
    seen = check_every_fused_forward(monkeypatch, runner.model)
    assert _run(runner, [prompt], [40]) == plain
    assert "TARGET_VERIFY" in {mode for mode, _ in seen}


def test_fp32_adapter_rows_run_fused_bit_identically(tmp_path, monkeypatch):
    """A batch mixing the base model and two PEFT adapters in fp32 stays in the loop, whose deltas
    after each projection (csrc/cpu_lora.cpp, which the Python layers call too) are bit-identical
    to the Python layers' (prefills and decodes, adapters swapped through one slot fewer than
    they are)."""
    source, lora = llama_with_adapters(tmp_path)
    runner = _runner(source, **lora)
    fused = runner.model.fused_decode
    assert runner.lora.pool.kernel == "cpu" and fused is not None and fused.lora
    lora_rows: list[int] = []
    seen = check_every_fused_forward(monkeypatch, runner.model, lora_rows)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 19, 3, 30, 12, 9)]
    adapters = ["all", None, "rslora", "all", None, "rslora"]
    out = _run(runner, prompts, [10] * 6, adapters)
    with_lora = [mode for (mode, _), n in zip(seen, lora_rows) if n]
    assert {"EXTEND", "DECODE"} <= set(with_lora)
    monkeypatch.undo()
    plain = _runner(source, disable_fused_decode=True, **lora)
    assert _run(plain, prompts, [10] * 6, adapters) == out
    without = _runner(source, max_loras_per_batch=1)  # the adapters change the outputs
    assert _run(without, prompts, [10] * 6) != out
