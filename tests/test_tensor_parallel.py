"""Tensor parallelism on torch.distributed (gloo on this CPU): engine/distributed/.

- fp32 greedy tokens at TP=2 equal TP=1's on tiny random Llama (untied), Qwen2 (q/k/v biases, one
  KV head replicated on both ranks) and Qwen3 (q/k norm, tied, head size 24) configs, with an odd
  vocabulary (the last vocabulary shard is padded), through the real scheduler: overlap, chunked
  prefill, radix-cache hits (prefix slots a worker only learns from rank 0's table writes) and
  requests joining mid-run.
- Each rank holds about 1/N of the weights (it reads only its slice of the checkpoint).
- The default model at TP=3 (9 query / 3 KV heads) in fp32 gives TP=1's text; in bf16 every
  token is transformers bf16's top choice or a near-tie (the bf16 bar of test_greedy_default_model).
- A worker rank that dies, mid-generation or idle, makes the engine unhealthy and ends the open
  requests with an error at once; a split the model does not allow is a typed error before any
  process starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine import Engine, EngineUnhealthyError, InvalidServerArgsError, SamplingParams, SyncScheduler
from engine.child_process import die_with_parent
from engine.distributed import launcher
from engine.distributed.driver import TPDriver
from engine.distributed.launcher import free_port
from engine.model_executor.model_runner import ModelRunner
from engine.server_args import ServerArgs
from tests.sched_harness import build_tiny_folder

VOCAB = 161  # odd: at TP=2 the second vocabulary shard is one row short (padded)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2-kv-replicated": lambda: Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
}
TIMEOUT = 120


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32)
    with torch.no_grad():  # weights far from uniform, biases included: greedy is not tie-prone
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def _prompts() -> list[list[int]]:
    shared = [(7 * j + 3) % VOCAB for j in range(40)]  # a 40-token prefix several requests share
    own = [[(11 * i + 5 * j) % VOCAB for j in range(3 + 4 * i)] for i in range(6)]
    return [shared + own[0], own[1], shared + own[2], shared + own[3], shared + own[4], own[5] + shared]


def _run(folder: str, tp: int, extras: dict | None = None) -> tuple[list[list[int]], list[int], list[dict]]:
    """Greedy outputs, cached prompt tokens and each rank's facts, for one TP size; `extras`
    collects a prompt-scoring request's log-probs and an embedding request's vector (both run
    beside the generations: the worker ranks join the LM head's gathers for the scored rows)."""
    args = ServerArgs(
        model_path=folder,
        dtype="float32",
        device="cpu",
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=32,
        tp_size=tp,
        torch_threads=1,
    )
    driver = TPDriver(args) if tp > 1 else None
    runner = driver.load() if driver is not None else ModelRunner(args)
    try:
        sched = SyncScheduler(runner, args)
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        prompts = _prompts()
        reqs = [sched.add_request(p, params) for p in prompts[:3]]
        if extras is not None:
            real = sched.process

            def process(lb, result):
                msg = real(lb, result)
                for rid, lp, emb in zip(msg.rids, msg.input_logprobs, msg.embeddings):
                    extras.update({rid: lp} if lp is not None else {rid: emb} if emb is not None else {})
                return msg

            sched.process = process
            sched.add_request(
                prompts[3], SamplingParams(max_new_tokens=0), "score", top_logprobs_num=2, logprob_start_len=0
            )
            sched.add_request(prompts[5], SamplingParams(), "embed", pooling="mean")

        def join(step: int) -> None:  # the rest join mid-run, after the shared prefix is cached
            if step == 4:
                reqs.extend(sched.add_request(p, params) for p in prompts[3:])

        sched.run_until_idle(overlap=True, on_step=join)
        return [r.output_ids for r in reqs], [r.cached_tokens for r in reqs], runner.tp_ranks
    finally:
        if driver is not None:
            driver.stop(healthy=True)


def test_tp2_greedy_tokens_equal_tp1(tiny):
    want_extras, got_extras = {}, {}
    want, cached, _ = _run(tiny, 1, want_extras)
    got, cached_tp, ranks = _run(tiny, 2, got_extras)
    assert got == want
    score, want_score = got_extras["score"], want_extras["score"]
    assert score.ids == want_score.ids and len(score.values) == len(_prompts()[3])
    assert score.values[1:] == pytest.approx(want_score.values[1:], abs=1e-4)
    assert [[t for t, _ in row] for row in score.top[1:]] == [[t for t, _ in row] for row in want_score.top[1:]]
    assert got_extras["embed"] == pytest.approx(want_extras["embed"], abs=1e-5)
    assert cached_tp == cached and sum(cached) >= 2 * 40  # the joiners' shared prefix came from the cache
    [whole] = _run_ranks_single(tiny)
    assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
    for r in ranks:  # about half each: only the norms (and a KV head fewer than ranks) are replicated
        assert 0.45 * whole <= r["weight_bytes"] <= 0.55 * whole, (r, whole)
        assert r["kv_pool_tokens"] == 4096


def _run_ranks_single(folder: str) -> list[int]:
    args = ServerArgs(model_path=folder, dtype="float32", device="cpu", max_total_tokens=4096, torch_threads=1)
    return [ModelRunner(args).weight_bytes()]


def test_a_split_the_model_does_not_allow_is_refused_before_anything_starts(tiny, monkeypatch):
    args = ServerArgs(model_path=tiny, dtype="float32", device="cpu", max_total_tokens=4096, tp_size=3)
    spawned: list[list[str]] = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda cmd, *a, **kw: spawned.append(cmd))
    with pytest.raises(InvalidServerArgsError, match="tp_size 3 does not divide"):
        TPDriver(args).load()
    assert spawned == []  # no rank was spawned to find out


# ---- the default model ----------------------------------------------------------------------------

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,", "List colors:"]


async def _generate(tp: int, dtype: str) -> tuple[list[list[int]], list[list[int]]]:
    engine = Engine("smollm2-135m", dtype=dtype, device="cpu", tp_size=tp, max_total_tokens=4096)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    async with engine:
        async with asyncio.timeout(TIMEOUT):
            results = await asyncio.gather(*(engine.generate(t, params) for t in TEXTS))
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        return [r.token_ids for r in results], prompts


async def test_default_model_tp3_fp32_equals_tp1():
    want, _ = await _generate(1, "float32")
    got, _ = await _generate(3, "float32")
    assert got == want


async def test_default_model_tp3_bf16_tokens_are_transformers_top_choices(hf_default_model_bf16):
    outputs, prompts = await _generate(3, "bfloat16")
    hf = hf_default_model_bf16
    agree = total = 0
    with torch.no_grad():
        for p, ours in zip(prompts, outputs):
            logits = hf(torch.tensor([p + ours])).logits[0, len(p) - 1 : len(p) - 1 + len(ours)].float()
            gap = logits.max(-1).values - logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
            assert float(gap.max()) <= 0.5, f"a token is {float(gap.max()):.3f} below transformers' best"
            agree += int((gap == 0).sum())
            total += len(ours)
    assert agree >= 0.95 * total, f"only {agree}/{total} tokens are transformers' argmax"


# ---- a rank that dies -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-tp"), default_tokenizer)


def _tp_engine(folder: str) -> Engine:
    return Engine(folder, dtype="float32", device="cpu", tp_size=2, torch_threads=1, max_total_tokens=8192)


async def _worker_pid(engine: Engine) -> int:
    ranks = (await engine.get_internal_state())["tensor_parallel"]
    return next(int(r["pid"]) for r in ranks if r["rank"] == 1)


async def test_a_worker_killed_mid_generation_fails_its_requests_and_the_engine(tiny_tok_folder):
    async with _tp_engine(tiny_tok_folder) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
        first = await engine.generate("warm up", SamplingParams(max_new_tokens=4))
        assert first.finish_reason == "length"
        pid = await _worker_pid(engine)
        stream = engine.open_stream("a long answer", params)
        got, killed = 0, False
        async with asyncio.timeout(TIMEOUT):
            async for delta in stream:
                got += len(delta.token_ids)
                if got >= 8 and not killed:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                last = delta
            reason = await engine.wait_unhealthy()
        # Seen by the rank's death (its exit or a failed collective), not the forward watchdog.
        assert killed and "did not complete within" not in reason
        assert last.finish_reason == "abort" and "tensor-parallel" in (last.error or "")
        assert not engine.healthy and "tensor-parallel" in reason
        with pytest.raises(EngineUnhealthyError):
            await engine.generate("after", SamplingParams(max_new_tokens=2))


async def test_killed_idle_worker_turns_the_engine_unhealthy(tiny_tok_folder):
    async with _tp_engine(tiny_tok_folder) as engine:
        await engine.generate("hello", SamplingParams(max_new_tokens=2))
        os.kill(await _worker_pid(engine), signal.SIGKILL)
        async with asyncio.timeout(60):  # a hang guard, generous for a busy machine
            reason = await engine.wait_unhealthy()
        assert "tensor-parallel rank 1" in reason and "exited" in reason
        with pytest.raises(EngineUnhealthyError):
            await engine.generate("after", SamplingParams(max_new_tokens=2))


async def test_two_hosts_on_loopback_serve_as_one(tiny_tok_folder):
    """SGLang's multi-host flags: node 1 is `python -m server --node-rank 1` (workers only, no HTTP),
    node 0 the engine; greedy output equals TP=1's, and stopping node 0 ends node 1 with status 0."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    async with Engine(tiny_tok_folder, dtype="float32", device="cpu", torch_threads=1) as single:
        want = (await single.generate("two hosts", params)).token_ids
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--dtype", "float32", "--device", "cpu"]
    parent = os.getpid()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "server", "--model-path", tiny_tok_folder, *common, "--node-rank", "1"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: die_with_parent(parent),
    )
    try:
        engine = Engine(
            tiny_tok_folder,
            dtype="float32",
            device="cpu",
            torch_threads=1,
            tp_size=2,
            nnodes=2,
            node_rank=0,
            dist_init_addr=addr,
        )
        async with engine:
            async with asyncio.timeout(TIMEOUT):
                got = await engine.generate("two hosts", params)
            ranks = (await engine.get_internal_state())["tensor_parallel"]
        assert got.token_ids == want
        assert [r["rank"] for r in ranks] == [0, 1]
        assert node1.wait(30) == 0
        assert "node 1: ranks [1]" in node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
