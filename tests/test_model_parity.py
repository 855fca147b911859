"""Our model's logits match transformers' on tiny random-weight Llama/Qwen2/Qwen3 configs.

Checked at prefill (every prompt position, a batch of different lengths), after a cached-prefix
extend (prefix KV reused from another request's slots, as the radix cache does), and over several
decode steps; page sizes 1 and 16 must give the same numbers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req
from engine.server_args import ServerArgs

VOCAB = 160
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-tied-llama3rope": lambda: LlamaConfig(
        **COMMON,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
}

PROMPT_LENS = [5, 33, 17, 9]
PREFIX_FROM, PREFIX_LEN = 1, 16  # a page-aligned prefix of request 1's prompt is reused
DECODE_STEPS = 4
ATOL = 2e-4


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    """(folder, transformers model) for one tiny random-weight architecture."""
    torch.manual_seed(0)
    cfg = CONFIGS[request.param]()
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    # Random init draws tiny weights; scale them up so logits are far from uniform and errors show.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
            else:
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _new_req(i: int, ids: list[int]) -> Req:
    return Req(f"r{i}", ids, SamplingParams(temperature=0.0), seed=i, max_context_len=256)


def _run_all(folder, page_size: int, prompts: list[list[int]], decode_tokens: list[list[int]]):
    """Prefill, cached-prefix extend and teacher-forced decode; returns every logits tensor."""
    args = ServerArgs(
        model_path=str(folder),
        dtype="float32",
        device="cpu",
        max_total_tokens=2048,
        page_size=page_size,
        max_running_requests=8,
    )
    runner = ModelRunner(args, resolve_model(str(folder)))
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator

    def batch_of(reqs):
        return ScheduleBatch.init_new(reqs, pool, alloc, None, VOCAB)

    reqs = [_new_req(i, p) for i, p in enumerate(prompts)]
    for r in reqs:
        r.init_next_round_input()
    batch = batch_of(reqs)
    assert batch.prepare_for_extend()
    prefill = runner.forward(batch.get_model_worker_batch(return_prompt_logits=True))

    # A new request whose first PREFIX_LEN tokens are already cached in request 1's slots.
    src = reqs[PREFIX_FROM]
    ext_ids = prompts[PREFIX_FROM][:PREFIX_LEN] + [7, 3, 11, 5, 2]
    ext = _new_req(99, ext_ids)
    ext.init_next_round_input()
    ext.prefix_indices = pool.req_to_token[src.req_pool_idx, :PREFIX_LEN].to(torch.int64)
    ext.extend_input_len = len(ext_ids) - PREFIX_LEN
    ext_batch = batch_of([ext])
    assert ext_batch.prepare_for_extend()
    extend = runner.forward(ext_batch.get_model_worker_batch(return_prompt_logits=True))

    decodes = []
    for step in range(DECODE_STEPS):
        for r, toks in zip(reqs, decode_tokens):
            r.output_ids.append(toks[step])
        assert batch.prepare_for_decode()
        decodes.append(runner.forward(batch.get_model_worker_batch()))
    return prefill, extend, ext_ids, decodes


def test_logits_match_transformers(tiny):
    folder, hf = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]
    decode_tokens = [torch.randint(0, VOCAB, (DECODE_STEPS,), generator=g).tolist() for _ in PROMPT_LENS]

    results = {ps: _run_all(folder, ps, prompts, decode_tokens) for ps in (1, 16)}
    prefill, extend, ext_ids, decodes = results[1]

    # Prefill: every position of every prompt in the mixed-length batch.
    start = 0
    for p in prompts:
        ref = _hf_logits(hf, p)
        torch.testing.assert_close(prefill[start : start + len(p)], ref, atol=ATOL, rtol=1e-4)
        start += len(p)
    # Cached-prefix extend: positions after the prefix.
    ref = _hf_logits(hf, ext_ids)[PREFIX_LEN:]
    torch.testing.assert_close(extend, ref, atol=ATOL, rtol=1e-4)
    # Decode: teacher-forced tokens, logits of the last position each step.
    for step, logits in enumerate(decodes):
        for i, p in enumerate(prompts):
            ref = _hf_logits(hf, p + decode_tokens[i][: step + 1])[-1]
            torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)

    # Page size 16 computes the same numbers.
    p16 = results[16]
    torch.testing.assert_close(p16[0], prefill, atol=1e-6, rtol=0)
    torch.testing.assert_close(p16[1], extend, atol=1e-6, rtol=0)
    for a, b in zip(p16[3], decodes):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # The logits are informative (not a degenerate near-uniform distribution).
    assert prefill.std() > 0.5
