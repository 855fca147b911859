"""The in-process Engine end to end: actors, device stream, output processing, aborts, failures.

Most tests use a tiny random Llama that carries the real SmolLM2 tokenizer (fast, and text paths
are real); text-quality tests (stop strings, UTF-8) use the default model.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from engine import Engine, SamplingParams
from engine.errors import ContextLengthExceededError, InvalidRequestError, RequestTooLargeError
from engine.model_executor.model_runner import ModelRunner
from tests.sched_harness import build_tiny_folder

TIMEOUT = 120


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-with-tokenizer"), default_tokenizer)


def tiny_engine(folder: str, **kw) -> Engine:
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=16384, max_running_requests=64)
    opts.update(kw)
    return Engine(folder, **opts)


async def assert_idle_and_clean(engine: Engine) -> dict:
    """Memory invariant once the engine is idle: everything free or evictable, no errors."""
    async with asyncio.timeout(30):
        while True:
            st = await engine.get_internal_state()
            if st["running_requests"] == 0 and st["waiting_requests"] == 0 and st["protected_tokens"] == 0:
                break
            await asyncio.sleep(0.01)
    assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
    assert st["memory_errors"] == [], st["memory_errors"]
    return st


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randint(4, 120))] for _ in range(n)]


async def test_concurrent_equals_alone_overlap_on_and_off(tiny_tok_folder):
    prompts = _prompts(48)
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + i % 17, ignore_eos=True) for i in range(48)]
    results = {}
    for overlap in (True, False):
        async with tiny_engine(tiny_tok_folder, enable_overlap=overlap, chunked_prefill_size=64) as engine:
            async with asyncio.timeout(TIMEOUT):
                outs = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params)))
            results[overlap] = [o.token_ids for o in outs]
            await assert_idle_and_clean(engine)
    async with tiny_engine(tiny_tok_folder, disable_radix_cache=True) as engine:
        alone = [(await engine.generate(p, sp)).token_ids for p, sp in zip(prompts, params)]
    assert results[True] == alone
    assert results[False] == alone
    assert all(len(a) == sp.max_new_tokens for a, sp in zip(alone, params))


async def test_shared_prefix_hit_rate(tiny_tok_folder):
    rng = random.Random(3)
    groups, per_group, sys_len, q_len = 4, 8, 256, 16
    system = [[rng.randrange(100, 40000) for _ in range(sys_len)] for _ in range(groups)]
    prompts = [s + [rng.randrange(100, 40000) for _ in range(q_len)] for s in system for _ in range(per_group)]
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    async with tiny_engine(tiny_tok_folder) as engine:
        # First one per group warms the cache, then the rest arrive together.
        firsts = await asyncio.gather(*(engine.generate(prompts[g * per_group], params) for g in range(groups)))
        rest = await asyncio.gather(*(engine.generate(p, params) for i, p in enumerate(prompts) if i % per_group != 0))
        assert all(r.cached_tokens == 0 for r in firsts)
        cached = sum(r.cached_tokens for r in rest)
        ideal = len(rest) * sys_len
        assert cached >= 0.8 * ideal, (cached, ideal)
        st = await assert_idle_and_clean(engine)
        assert st["cache_hit_rate"] > 0.5


async def test_small_pool_retracts_and_oversized_request_fails(tiny_tok_folder):
    prompts = _prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True)
    async with tiny_engine(tiny_tok_folder, disable_radix_cache=True) as engine:
        alone = [(await engine.generate(p, params)).token_ids for p in prompts]
    async with tiny_engine(tiny_tok_folder, max_total_tokens=900) as engine:
        async with asyncio.timeout(TIMEOUT):
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        assert [o.token_ids for o in outs] == alone
        st = await assert_idle_and_clean(engine)
        assert st["num_retractions"] > 0
        with pytest.raises(RequestTooLargeError, match="KV cache pool"):
            await engine.generate(list(range(100, 1100)), params)
        # A prompt that fits but whose output can never fit alone ends with a clear error.
        async with asyncio.timeout(TIMEOUT):
            res = await engine.generate(list(range(100, 600)), SamplingParams(max_new_tokens=1000, ignore_eos=True))
        assert res.finish_reason == "abort" and "does not fit" in res.error
        await assert_idle_and_clean(engine)


async def test_aborts_free_memory_at_once(tiny_tok_folder):
    async with tiny_engine(tiny_tok_folder) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
        # In-process abort.
        stream = engine.stream(_prompts(1)[0], params, rid="to-abort")
        first = await anext(stream)
        assert first.token_ids
        await engine.abort("to-abort")
        st = await engine.get_internal_state()
        assert st["running_requests"] == 0 and st["protected_tokens"] == 0
        await stream.aclose()
        # Dropping the stream aborts too.
        stream = engine.stream(_prompts(1, seed=9)[0], params)
        await anext(stream)
        await stream.aclose()
        await assert_idle_and_clean(engine)

        # Hundreds of random aborts while others run to completion.
        rng = random.Random(11)
        prompts = _prompts(200, seed=12)

        async def one(i: int):
            sp = SamplingParams(temperature=0.0, max_new_tokens=rng.randint(1, 30), ignore_eos=True)
            if rng.random() < 0.5:
                task = asyncio.ensure_future(engine.generate(prompts[i], sp, rid=f"x{i}"))
                await asyncio.sleep(rng.random() * 0.05)
                await engine.abort(f"x{i}")
                res = await task
                assert res.finish_reason in ("abort", "length")
                return None
            res = await engine.generate(prompts[i], sp)
            assert res.finish_reason == "length" and len(res.token_ids) == sp.max_new_tokens
            return res

        async with asyncio.timeout(TIMEOUT):
            done = await asyncio.gather(*(one(i) for i in range(200)))
        assert sum(r is not None for r in done) > 50
        await assert_idle_and_clean(engine)
        assert engine.healthy


async def test_forward_exception_fails_requests_and_engine_keeps_serving(tiny_tok_folder, monkeypatch):
    async with tiny_engine(tiny_tok_folder) as engine:
        real = ModelRunner.forward_batch_generation
        calls = {"n": 0}

        def flaky(runner, batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected device failure")
            return real(runner, batch)

        monkeypatch.setattr(ModelRunner, "forward_batch_generation", flaky)
        try:
            params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
            async with asyncio.timeout(TIMEOUT):
                res = await asyncio.gather(*(engine.generate(p, params) for p in _prompts(4, seed=2)))
            failed = [r for r in res if r.finish_reason == "abort"]
            assert failed and all("injected device failure" in r.error for r in failed)
            assert engine.healthy
            async with asyncio.timeout(TIMEOUT):
                ok = await engine.generate(_prompts(1)[0], params)
            assert ok.finish_reason == "length" and len(ok.token_ids) == 10
            await assert_idle_and_clean(engine)
        finally:
            monkeypatch.undo()


async def test_bad_input_gets_typed_errors(tiny_tok_folder):
    async with tiny_engine(tiny_tok_folder, context_length=256) as engine:
        with pytest.raises(InvalidRequestError) as e:
            await engine.generate("hi", SamplingParams(temperature=-1))
        assert e.value.param == "temperature"
        with pytest.raises(ContextLengthExceededError):
            await engine.generate(list(range(100, 400)))
        with pytest.raises(InvalidRequestError):
            await engine.generate("")
        with pytest.raises(InvalidRequestError):
            await engine.generate([10**9])
        with pytest.raises(InvalidRequestError):
            await engine.generate([{"no-role": 1}])
        res = await engine.generate("still fine", SamplingParams(max_new_tokens=2))
        assert res.completion_tokens == 2 or res.finish_reason == "stop"
        await assert_idle_and_clean(engine)


async def test_seeded_sampling_reproducible_across_batches(tiny_tok_folder):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=12, seed=1234, ignore_eos=True)
    target = _prompts(1, seed=21)[0]
    async with tiny_engine(tiny_tok_folder) as engine:
        alone = (await engine.generate(target, params)).token_ids
        others = [
            engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True))
            for p in _prompts(7, seed=22)
        ]
        res = await asyncio.gather(*others[:3], engine.generate(target, params), *others[3:])
        assert res[3].token_ids == alone
        other_seed = await engine.generate(target, SamplingParams(**{**_fields(params), "seed": 99}))
        assert other_seed.token_ids != alone


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_overlap_defaults_to_cuda_only():
    from engine.server_args import ServerArgs
    from server.cli import parse_args

    assert ServerArgs(device="cpu").resolved_enable_overlap() is False
    assert ServerArgs(device="cuda").resolved_enable_overlap() is True
    assert ServerArgs(device="cpu", enable_overlap=True).resolved_enable_overlap() is True
    assert parse_args(["--enable-overlap-schedule"])[0]["enable_overlap"] is True
    assert parse_args(["--disable-overlap-schedule"])[0]["enable_overlap"] is False
    assert "enable_overlap" not in parse_args([])[0]


def test_auto_dtype_follows_the_hardware(monkeypatch):
    """auto = bfloat16 where bf16 is native (CUDA, AVX512-BF16 or AMX CPUs), float32 elsewhere."""
    import torch

    from engine.server_args import ServerArgs

    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: False)
    assert ServerArgs(device="cpu").resolved_dtype() == torch.float32
    assert ServerArgs(device="cuda").resolved_dtype() == torch.bfloat16
    assert ServerArgs(device="cpu", dtype="bf16").resolved_dtype() == torch.bfloat16  # asked for: honoured
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert ServerArgs(device="cpu").resolved_dtype() == torch.bfloat16


async def test_queue_time_is_reported_once_scheduled(tiny_tok_folder):
    async with tiny_engine(tiny_tok_folder, max_running_requests=1) as engine:
        params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)

        async def deltas(prompt: list[int]) -> list:
            return [d async for d in engine.stream(prompt, params)]

        first, second = await asyncio.gather(*(deltas(p) for p in _prompts(2)))
    # One runs at a time: the second waited about as long as the first ran.
    assert first[0].queue_time is not None and second[0].queue_time is not None
    assert second[0].queue_time > first[0].queue_time
