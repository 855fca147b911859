"""Test helpers: a tiny real transformers model on disk, and a synchronous scheduler loop.

The synchronous loop reproduces the overlap schedule exactly (plan N+1 before processing the
result of N) without asyncio, so scheduler decisions can be tested step by step.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.actors.scheduler import Scheduler
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from engine.sampling import SamplingParams
from engine.scheduler.batch import Req
from engine.server_args import ServerArgs

TINY_VOCAB = 512


def save_random_llama(folder: Path, cfg: LlamaConfig) -> Path:
    """Build `cfg` with weights scaled so logits are far from uniform (greedy is not tie-prone)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tiny_llama(folder: Path) -> Path:
    """A 2-layer random Llama over a small vocabulary, no tokenizer (scheduler tests)."""
    cfg = LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=None,
        bos_token_id=None,
    )  # fmt: skip
    return save_random_llama(folder, cfg)


def build_tiny_folder(folder: Path, tokenizer) -> str:
    """A 2-layer random Llama with the real tokenizer saved beside it: fast, and every text path
    (tokenize, chat template, detokenize) is real."""
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
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


def run_sync(sched: Scheduler, overlap: bool, max_steps: int = 100_000, on_step=None) -> int:
    """Drive the scheduler until idle; returns the number of forwards run."""
    runner = sched.runner
    pending = None  # (LaunchedBatch, result) launched but not yet processed
    steps = 0
    while steps < max_steps:
        batch = sched.get_next_batch_to_run()
        launched = None
        if batch is not None:
            lb = sched.launched(batch)
            launched = (lb, runner.forward_batch_generation(batch.get_model_worker_batch()))
            steps += 1
        if overlap:
            if pending is not None:
                sched.process_batch_result(*pending)
            pending = launched
        elif launched is not None:
            sched.process_batch_result(*launched)
        if on_step is not None:
            on_step(steps)
        if launched is None and pending is None and batch is None:
            if sched.is_idle():
                return steps
            if not sched.waiting_queue and sched.chunked_req is None and sched.running_batch.is_empty():
                return steps
    raise AssertionError("scheduler did not become idle")
