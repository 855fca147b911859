"""Test helpers: a tiny real transformers model on disk, runners over it, and requests.

Scheduler decisions are tested step by step with `engine.SyncScheduler` (its `run_until_idle`
reproduces the overlap schedule exactly, planning N+1 before processing the result of N).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from engine.scheduler.req import Req
from engine.server_args import ServerArgs

TINY_VOCAB = 512


def save_random_llama(folder: Path, cfg: LlamaConfig, damped: tuple[str, ...] = ()) -> Path:
    """Build `cfg` with weights scaled so logits are far from uniform (greedy is not tie-prone);
    weights whose names end with one of `damped` get 1/20 of that scale."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 * (0.05 if damped and name.endswith(damped) else 1.0))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tiny_llama(
    folder: Path, vocab_size: int = TINY_VOCAB, tie_word_embeddings: bool = False, damped: tuple[str, ...] = ()
) -> Path:
    """A 2-layer random Llama over a small vocabulary, no tokenizer (scheduler tests)."""
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=None,
        bos_token_id=None,
    )
    return save_random_llama(folder, cfg, damped)


def build_tiny_folder(folder: Path, tokenizer) -> str:
    """A 2-layer random Llama with the real tokenizer saved beside it: fast, and every text path
    (tokenize, chat template, detokenize) is real."""
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    save_random_llama(folder, cfg)
    tokenizer.save_pretrained(folder)
    return str(folder)


def make_runner(folder: Path, **overrides) -> tuple[ModelRunner, ServerArgs]:
    kw = dict(model_path=str(folder), dtype="float32", device="cpu", max_total_tokens=8192, max_running_requests=64)
    kw.update(overrides)
    args = ServerArgs(**kw)
    return ModelRunner(args, resolve_model(str(folder))), args


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TINY_VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def new_req(i: int, ids: list[int], params: SamplingParams, seed: int = 0, context_len: int = 1024) -> Req:
    return Req(f"r{i}", ids, params, seed=seed or i + 1, max_context_len=context_len)
