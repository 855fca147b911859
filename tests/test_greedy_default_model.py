"""Default model, fp32: greedy output token-identical to transformers' generate on the same GGUF;
bf16: every greedy token is transformers bf16's top choice or a near-tie.

Twelve varied prompts (raw text and chat-templated, a few tokens to several hundred) run as one
continuous batch: half start together, the rest join while the first ones are decoding, so the
batch mixes prefill lengths and decode progress.
"""

from __future__ import annotations

import pytest

from bench.gpu_parity import first_diff, teacher_forced
from bench.parity_prompts import parity_prompts
from engine import SyncScheduler
from engine.model_executor.model_runner import ModelRunner
from engine.sampling import SamplingParams
from engine.server_args import ServerArgs
from tests.hf_reference import hf_greedy_outputs

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return parity_prompts(default_tokenizer)


@pytest.fixture(scope="module")
def hf_outputs(hf_default_model, prompts) -> list[list[int]]:
    return hf_greedy_outputs(hf_default_model, prompts, NEW_TOKENS)


def test_prompt_mix_is_varied(prompts):
    lens = sorted(len(p) for p in prompts)
    assert len(prompts) >= 10 and lens[0] < 16 and lens[-1] > 300


def test_greedy_matches_transformers_in_continuous_batch(default_source, default_tokenizer, prompts, hf_outputs):
    args = ServerArgs(dtype="float32", device="cpu", max_total_tokens=16384, max_running_requests=32)
    runner = ModelRunner(args, default_source)
    sched = SyncScheduler(runner)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    first = [sched.add_request(p, params) for p in prompts[::2]]
    for _ in range(5):  # the first half prefills and decodes a few steps before the rest join
        sched.step()
    second = [sched.add_request(p, params) for p in prompts[1::2]]
    sched.run_until_idle()

    reqs = [None] * len(prompts)
    reqs[::2], reqs[1::2] = first, second
    for i, (req, ref) in enumerate(zip(reqs, hf_outputs)):
        assert req.output_ids == ref, f"prompt {i}: diverged at token {first_diff(req.output_ids, ref)}"
    # Everything was freed: the KV is free or in the prefix cache, and is all free once flushed.
    sched.scheduler.check_memory()
    assert sched.scheduler.flush_cache()
    assert runner.token_to_kv_pool_allocator.available_size() == runner.token_to_kv_pool_allocator.size
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size


BF16_NEW_TOKENS = 48


def test_bf16_greedy_tokens_are_transformers_top_choices(default_source, hf_default_model_bf16, prompts):
    """bf16, the fast CPU path (AVX512-BF16 attention kernels where the CPU has them, fused RMSNorm
    and SiLU-and-mul): bf16 greedy is not bit-reproducible across kernels (transformers' own bf16
    `generate` drifts from its full-sequence forward), so each token we pick is checked teacher-forced
    against transformers bf16 on the same sequence: nearly always its argmax, and otherwise a near-tie
    within bf16 logit resolution. A wrong kernel shows up as large gaps at once."""
    args = ServerArgs(dtype="bfloat16", device="cpu", max_total_tokens=16384, max_running_requests=32)
    runner = ModelRunner(args, default_source)
    assert runner.model.fused  # the kernels build here (tests/test_cpu_attention_kernels.py insists)
    sched = SyncScheduler(runner)
    params = SamplingParams(temperature=0.0, max_new_tokens=BF16_NEW_TOKENS)
    reqs = [sched.add_request(p, params) for p in prompts]
    sched.run_until_idle()
    bar = teacher_forced(hf_default_model_bf16, prompts, [r.output_ids for r in reqs])
    assert bar["ok"], bar  # every token within 0.5 of the best logit, >= 97% transformers' argmax
