"""Granite, OLMo 2 and Phi-3 (issue 31): tiny random configs against transformers.

- fp32, through the real scheduler: greedy tokens identical to transformers' `generate` for a
  batch mixing short and long prompts (long ones chunked: `chunked_prefill_size` 16), a request
  joining mid-run, and a radix-cache hit (a prompt sharing a cached prefix, run after it); prompt
  log-probs (the logits themselves: Granite's `logits_scaling` included) within 1e-4.
  Each family in two shapes: Granite with multipliers, q/k/v/o and MLP biases, tied and untied;
  OLMo 2 with GQA and MHA, biases, tied and untied; Phi-3 with partial rotary and with longrope
  (whose context is bounded by `original_max_position_embeddings`).
- TP=2: Phi-3 (its fused q|k|v and gate|up tensors split per rank) and OLMo 2 (its whole-q/k
  norm's statistics all-reduced) give transformers' tokens.
- bf16: every greedy token is transformers bf16's top choice or a near-tie (the bar of
  test_greedy_default_model); the fused C++ decode loop runs only the layers it implements
  (Phi-3's, not Granite's or OLMo 2's), each projection still takes its oneDNN form.
- An architecture we have no model code for still fails at once, naming it.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteConfig, Olmo2Config, Phi3Config

from bench.gpu_parity import teacher_forced
from engine import ContextLengthExceededError, SyncScheduler
from engine.distributed.driver import TPDriver
from engine.errors import ModelLoadError
from engine.kernels import cpu_quant, cpu_vnni
from engine.layers.linear import OneDNNLinear, VnniLinear, onednn_bf16_available
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import SUPPORTED_ARCHITECTURES, resolve_model
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs
from tests.test_model_parity import COMMON as PARITY_SHAPE
from tests.test_model_parity import VOCAB

NEW_TOKENS = 10
NO_SPECIAL = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)  # generate runs every token
COMMON = dict(PARITY_SHAPE, **NO_SPECIAL)  # test_model_parity.py's tiny shape
GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1, logits_scaling=8.0)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)], "long_factor": [4.0] * 8}

# name -> (config, weight init: (matrices' std, 1-D params' uniform range, embedding std))
PLAIN_INIT, OLMO2_INIT, PHI3_INIT = (0.3, 0.5, 1.5, 0.3), (0.3, 0.1, 0.4, 1.0), (0.15, 0.5, 1.5, 0.15)
FAMILIES = {
    "granite-bias": (
        lambda: GraniteConfig(**COMMON, **GRANITE, attention_bias=True, mlp_bias=True),
        PLAIN_INIT,
    ),
    "granite-tied-hd32": (
        lambda: GraniteConfig(
            **(COMMON | dict(num_attention_heads=2, num_key_value_heads=1)), **GRANITE, tie_word_embeddings=True
        ),
        PLAIN_INIT,
    ),
    "olmo2": (lambda: Olmo2Config(**COMMON), OLMO2_INIT),
    "olmo2-tied-mha-bias": (
        lambda: Olmo2Config(**(COMMON | dict(num_key_value_heads=4)), attention_bias=True, tie_word_embeddings=True),
        OLMO2_INIT,
    ),
    "phi3-partial-rotary": (lambda: Phi3Config(**COMMON, partial_rotary_factor=0.5), PHI3_INIT),
    "phi3-longrope-tied": (
        lambda: Phi3Config(
            **(COMMON | dict(max_position_embeddings=512)),
            original_max_position_embeddings=128,
            rope_scaling=LONGROPE,
            tie_word_embeddings=True,
        ),
        PHI3_INIT,
    ),
}


def save_random_model(cfg, init: tuple[float, float, float, float], folder, dtype=torch.float32):
    """A random-weight transformers model of `cfg` (logits far from uniform: greedy is not
    tie-prone), saved as safetensors in `folder`; returns it."""
    std, lo, hi, embed_std = init
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name:
                p.normal_(0, embed_std)
            else:
                p.normal_(0, std) if p.dim() > 1 else p.uniform_(lo, hi)
    model.save_pretrained(folder, safe_serialization=True)
    return model.to(dtype)


def hf_greedy(model, prompt: list[int]) -> list[int]:
    inp = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(prompt) :].tolist()


SHARED = [(7 * j + 3) % VOCAB for j in range(32)]  # a prefix the radix cache serves to a later prompt


def family_prompts() -> tuple[list[list[int]], list[int], list[int]]:
    """A batch of short and long prompts (one holding SHARED), one to join mid-run, one reusing SHARED."""
    g = torch.Generator().manual_seed(1)
    rand = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 70, 9, 41, 5, 6)]
    return [rand[0], rand[1], SHARED + rand[2], rand[3]], rand[4], SHARED + rand[5]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    cfg, init = FAMILIES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, str(folder), save_random_model(cfg(), init, folder)


def family_args(folder: str, **kw) -> ServerArgs:
    base = dict(model_path=folder, dtype="float32", device="cpu", max_total_tokens=4096, max_running_requests=8)
    return ServerArgs(**(base | dict(chunked_prefill_size=16) | kw))


def run_scheduler(sched: SyncScheduler) -> tuple[list, list[int], object]:
    """Phase 1: the mixed batch, one request joining at step 3 and a prompt-scoring request;
    phase 2 (all finished, SHARED cached): the prompt reusing SHARED."""
    batch, joiner, reuser = family_prompts()
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    reqs = [sched.add_request(p, params) for p in batch]
    sched.add_request(batch[1], SamplingParams(max_new_tokens=0), "score", logprob_start_len=0, return_logprob=True)
    scored = {}
    real = sched.process

    def process(lb, result):  # the prompt log-probs leave with the request's last prefill chunk
        msg = real(lb, result)
        scored.update((rid, lp) for rid, lp in zip(msg.rids, msg.input_logprobs) if lp is not None)
        return msg

    sched.process = process

    def join(step: int) -> None:
        if step == 3:
            reqs.append(sched.add_request(joiner, params))

    sched.run_until_idle(on_step=join)
    reqs.append(sched.add_request(reuser, params))
    sched.run_until_idle()
    sched.scheduler.check_memory()
    return reqs, [*batch, joiner, reuser], scored["score"]


def assert_scheduler_matches_transformers(runner: ModelRunner, hf, name: str) -> None:
    """`run_scheduler` on `runner`: every request's greedy tokens are transformers' `generate`'s,
    the last prompt's prefix came from the radix cache, and the scored prompt's log-probs are
    transformers' within 1e-4."""
    reqs, prompts, score = run_scheduler(SyncScheduler(runner, runner.args))
    for i, (req, prompt) in enumerate(zip(reqs, prompts)):
        assert req.output_ids == hf_greedy(hf, prompt), f"{name}: prompt {i} ({len(prompt)} tokens)"
    assert reqs[-1].cached_tokens >= len(SHARED)  # the last prompt's prefix came from the radix cache
    with torch.no_grad():  # the scored prompt: log-probs of tokens 1.. under transformers' logits
        ids = prompts[1]
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)[:-1]
        ref = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(score.values) == len(ids) and score.values[1:] == pytest.approx(ref.tolist(), abs=1e-4)


def assert_tp2_matches_transformers(folder: str, hf, **overrides: object) -> ModelRunner:
    """`run_scheduler` under `--tp-size 2` on `folder`: greedy tokens equal transformers'; rank 0's runner."""
    args = family_args(folder, tp_size=2, torch_threads=1, **overrides)
    driver = TPDriver(args)
    try:
        runner = driver.load()
        reqs, prompts, _ = run_scheduler(SyncScheduler(runner, args))
    finally:
        driver.stop(healthy=True)
    assert [r.output_ids for r in reqs] == [hf_greedy(hf, p) for p in prompts]
    return runner


def test_greedy_tokens_and_logprobs_equal_transformers(family):
    name, folder, hf = family
    runner = ModelRunner(family_args(folder))
    assert_scheduler_matches_transformers(runner, hf, name)
    if name.startswith("phi3-longrope"):  # served within the short factors' range, exactly
        assert runner.context_len == 128
        with pytest.raises(ContextLengthExceededError):
            SyncScheduler(runner).add_request(list(range(130)), SamplingParams(max_new_tokens=1))


TP_FAMILIES = ["phi3-partial-rotary", "olmo2"]


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_tp2_greedy_tokens_equal_transformers(name, tmp_path):
    cfg, init = FAMILIES[name]
    assert_tp2_matches_transformers(str(tmp_path), save_random_model(cfg(), init, tmp_path))


# bf16: head size 64 and widths the fused kernels take, so only the layer shape decides the loop
BF16_SHAPE = dict(COMMON, vocab_size=512, hidden_size=256, intermediate_size=512)
# (config, weight init, whether the fused loop runs it). Tiny random models are near-tie-prone in
# bf16 (transformers' own bf16 differs from ours there); these inits spread the logits (std 0.3-1.3).
BF16 = {
    "granite": (lambda: GraniteConfig(**BF16_SHAPE, **GRANITE), (0.15, 0.8, 1.2, 0.15), False),
    "olmo2": (lambda: Olmo2Config(**BF16_SHAPE), (0.08, 0.8, 1.2, 0.08), False),
    "phi3": (lambda: Phi3Config(**BF16_SHAPE), (0.08, 0.1, 0.4, 2.0), True),
}


@pytest.mark.parametrize("name", list(BF16))
def test_bf16_greedy_tokens_are_transformers_top_choices(name, tmp_path):
    cfg, init, fused_loop = BF16[name]
    hf = save_random_model(cfg(), init, tmp_path, dtype=torch.bfloat16)
    runner = ModelRunner(family_args(str(tmp_path), dtype="bfloat16", chunked_prefill_size=None))
    model = runner.model
    if cpu_quant.vectorized():
        assert (model.fused_decode is not None) == fused_loop, name
    if cpu_vnni.available():  # bf16 dense weights in VNNI pairs (AVX512-BF16, no AMX), else oneDNN's
        assert isinstance(model.layers[0].self_attn.qkv_proj, VnniLinear)
    elif onednn_bf16_available():
        assert isinstance(model.layers[0].self_attn.qkv_proj, OneDNNLinear)
    assert_bf16_bar(runner, hf, name, vocab=512, lengths=(4, 37, 12, 60, 20, 90), new_tokens=24)


def assert_bf16_bar(runner: ModelRunner, hf, name: str, vocab: int, lengths: tuple[int, ...], new_tokens: int) -> None:
    """Greedy outputs of a batch of random prompts through the scheduler are transformers' top
    choices on our own sequences (bench.gpu_parity's bf16 bar)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    sched = SyncScheduler(runner)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    reqs = [sched.add_request(p, params) for p in prompts]
    sched.run_until_idle()
    bar = teacher_forced(hf, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], f"{name}: {bar}"


def test_an_unsupported_architecture_fails_naming_it(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPTNeoXForCausalLM'") as e:
        resolve_model(str(folder))
    assert all(arch in str(e.value) for arch in SUPPORTED_ARCHITECTURES)
    assert "Phi3ForCausalLM" in str(e.value) and "Olmo2ForCausalLM" in str(e.value)
    # A GGUF of a family served from safetensors only: refused by name, not half-loaded.
    path = tmp_path / "granite.gguf"
    w = gguf.GGUFWriter(str(path), "granite")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'granite'.*as GGUF: llama, qwen2, qwen3"):
        resolve_model(str(path))
