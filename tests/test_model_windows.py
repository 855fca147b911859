"""Mistral, Gemma 2 and Gemma 3 (issue 31): sliding windows, soft-caps, sandwich norms.

- fp32, through the real scheduler (test_model_families.py's run: a batch of short and long
  prompts chunked 16 tokens at a time, a request joining mid-run, a radix-cache hit): greedy
  tokens identical to transformers' `generate`, prompt log-probs within 1e-4. The windows are
  small (8-24 positions) so prompts and generations run far past them: every windowed layer
  reads only its window, on the CPU-kernel backend (head size 64) and the torch one.
- Gemma 2: attention-logit and final-logit soft-caps, alternating local/global layers,
  `query_pre_attn_scalar`, (1 + w) norms, GeGLU; Gemma 3: its per-head (1 + w) q/k norm and a
  RoPE base per layer type.
- The fused C++ decode loop runs a Mistral decode only while every sequence is inside the window.
- A speculative verify (n-gram) past the window gives the tokens of plain decoding.
- bf16: transformers' top choices (test_greedy_default_model's bar).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config, Qwen2Config

from bench.gpu_parity import teacher_forced
from engine import SyncScheduler
from engine.layers.attention_window import WindowedAttnBackend
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from tests.test_model_families import (
    COMMON,
    assert_scheduler_matches_transformers,
    assert_tp2_matches_transformers,
    family_args,
    hf_greedy,
    save_random_model,
)

PLAIN_INIT = (0.3, 0.5, 1.5, 0.3)  # (matrices' std, 1-D params' uniform range, embedding std)
GEMMA_INIT = (0.3, -0.5, 0.5, 0.3)  # Gemma's norms scale by 1 + w: w around 0
HD64 = dict(COMMON, hidden_size=128, intermediate_size=160, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
GEMMA3_LAYERS = dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"])

FAMILIES = {
    "mistral-window16": (lambda: MistralConfig(**COMMON, sliding_window=16), PLAIN_INIT, "auto"),
    "mistral-hd64-window8-tied": (
        lambda: MistralConfig(**HD64, sliding_window=8, tie_word_embeddings=True),
        PLAIN_INIT,
        "cpu",
    ),
    "phi3-window12": (lambda: Phi3Config(**COMMON, sliding_window=12), (0.15, 0.5, 1.5, 0.15), "auto"),
    # Qwen2's `use_sliding_window`: the layers from `max_window_layers` on are windowed
    "qwen2-swa-layer1": (
        lambda: Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=12, max_window_layers=1),
        PLAIN_INIT,
        "auto",
    ),
    "gemma2": (
        lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=12, query_pre_attn_scalar=24),
        GEMMA_INIT,
        "auto",
    ),
    "gemma2-softcaps-tight": (
        lambda: Gemma2Config(
            **COMMON, head_dim=16, sliding_window=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0
        ),
        GEMMA_INIT,
        "auto",
    ),
    "gemma3": (
        lambda: Gemma3TextConfig(**(COMMON | GEMMA3_LAYERS), head_dim=16, sliding_window=10, query_pre_attn_scalar=16),
        GEMMA_INIT,
        "auto",
    ),
    # Gemma's own head size on the C++ kernels: the soft-cap inside them, a bound window's decode
    # over its slots (attention_window.WindowPlan), extends past it in torch
    "gemma2-hd256-softcaps-cpu": (
        lambda: Gemma2Config(
            **COMMON, head_dim=256, sliding_window=12, query_pre_attn_scalar=256, attn_logit_softcapping=5.0
        ),
        GEMMA_INIT,
        "cpu",
    ),
    "gemma3-hd256-cpu": (
        lambda: Gemma3TextConfig(
            **(COMMON | GEMMA3_LAYERS), head_dim=256, sliding_window=10, query_pre_attn_scalar=256
        ),
        GEMMA_INIT,
        "cpu",
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    cfg, init, backend = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, str(folder), save_random_model(cfg(), init, folder), backend


def test_greedy_tokens_and_logprobs_equal_transformers(family):
    name, folder, hf, backend = family
    runner = ModelRunner(family_args(folder, attention_backend=backend))
    assert isinstance(runner.attn_backend, WindowedAttnBackend)
    assert runner.attn_backend.kernels == (backend == "cpu")
    assert_scheduler_matches_transformers(runner, hf, name)


def test_gemma_config_switches():
    from engine.model_config import ModelConfig

    cfg = ModelConfig.from_hf(FAMILIES["gemma3"][0](), "Gemma3ForCausalLM")
    assert cfg.layer_windows == (10, 10, 0) and cfg.rope_layer_types[2] == "full_attention"
    assert cfg.softmax_scale == 16**-0.5 and cfg.sandwich_norms and cfg.unit_offset_norms
    cfg2 = ModelConfig.from_hf(FAMILIES["gemma2-softcaps-tight"][0](), "Gemma2ForCausalLM")
    assert (cfg2.attn_logit_softcap, cfg2.final_logit_softcap) == (2.0, 3.0) and cfg2.hidden_act == "gelu_pytorch_tanh"
    qwen2 = ModelConfig.from_hf(FAMILIES["qwen2-swa-layer1"][0](), "Qwen2ForCausalLM")
    assert qwen2.layer_windows == (0, 12)
    mistral = ModelConfig.from_hf(MistralConfig(**COMMON, sliding_window=None), "MistralForCausalLM")
    assert mistral.layer_windows == ()  # no window: plain causal attention, no wrapper


def test_tp2_gemma2_greedy_tokens_equal_transformers(tmp_path):
    cfg, init, _ = FAMILIES["gemma2-softcaps-tight"]
    assert_tp2_matches_transformers(str(tmp_path), save_random_model(cfg(), init, tmp_path))


@pytest.mark.parametrize("name", ["mistral-window16", "mistral-hd64-window8-tied", "gemma2-hd256-softcaps-cpu"])
def test_speculative_verify_past_the_window_keeps_greedy_tokens(name, tmp_path):
    """A verify's positions each attend as a decode query over their own window: through torch ops,
    and on the C++ kernels over each position's window slots (with Gemma 2's soft-cap inside)."""
    cfg, init, backend = FAMILIES[name]
    hf = save_random_model(cfg(), init, tmp_path)
    args = family_args(
        str(tmp_path), speculative_algorithm="NGRAM", chunked_prefill_size=None, attention_backend=backend
    )
    runner = ModelRunner(args)
    prompt = [5, 6, 7, 8, 9] * 8  # repetitive: the n-gram drafter proposes, verify runs past the window
    sched = SyncScheduler(runner, runner.args)
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=10))
    sched.run_until_idle()
    assert req.output_ids == hf_greedy(hf, prompt)


def test_fused_decode_loop_only_inside_the_window(tmp_path):
    """bf16 Mistral: the C++ layer loop serves decodes while every sequence fits the window, the
    layers (with the windowed plan) after; tokens stay transformers' top choices throughout."""
    shape = dict(COMMON, vocab_size=512, hidden_size=256, intermediate_size=512)
    hf = save_random_model(MistralConfig(**shape, sliding_window=24), (0.08, 0.1, 0.4, 2.0), tmp_path, torch.bfloat16)
    runner = ModelRunner(family_args(str(tmp_path), dtype="bfloat16", chunked_prefill_size=None))
    fused = runner.model.fused_decode
    calls = {"fused": 0}
    if fused is not None:
        real = fused.forward

        def counting(*a, **kw):
            calls["fused"] += 1
            seq = a[3].seq_lens_cpu  # (x, cos, sin, fb, plan)
            assert max(seq) <= 24, seq  # never past the window
            return real(*a, **kw)

        fused.forward = counting
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (4, 12, 30)]
    sched = SyncScheduler(runner)
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    reqs = [sched.add_request(p, params) for p in prompts[:2]]  # inside the window for a while
    sched.run_until_idle()
    if fused is not None:
        assert calls["fused"] > 0
    reqs.append(sched.add_request(prompts[2], params))  # past it from its first decode
    sched.run_until_idle()
    bar = teacher_forced(hf, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], bar


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_bf16_greedy_tokens_are_transformers_top_choices(name, tmp_path):
    cfg, init, _ = FAMILIES[name]
    hf = save_random_model(cfg(), init, tmp_path, dtype=torch.bfloat16)
    runner = ModelRunner(family_args(str(tmp_path), dtype="bfloat16", chunked_prefill_size=None))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (4, 37, 12, 30)]
    sched = SyncScheduler(runner)
    reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=16)) for p in prompts]
    sched.run_until_idle()
    bar = teacher_forced(hf, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], f"{name}: {bar}"
