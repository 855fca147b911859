"""release_memory_occupation / resume_memory_occupation (the RL rollout issue): the process's RSS
drops by the KV pool and the weights, requests wait (none lost) while released, and outputs after
resume are the same as before."""

from __future__ import annotations

import asyncio
import gc

import psutil
import pytest
import torch

from engine import Engine, InvalidRequestError, SamplingParams
from engine.cache.memory_pool import KVCache
from tests.weight_helpers import greedy, hf_greedy, hf_named_tensors, make_checkpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_tokenizer) -> dict[str, str]:
    return make_checkpoints(tmp_path_factory.mktemp("memory"), default_tokenizer)


TEXT = "The capital of France is"


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


async def test_release_frees_the_kv_pool_and_weights_and_resume_restores_outputs():
    sp = SamplingParams(max_new_tokens=16, temperature=0)
    long = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True)
    async with Engine("smollm2-135m", max_total_tokens=16384) as engine:  # bf16, the default model
        before = await engine.generate(TEXT, sp)
        state = await engine.get_internal_state()
        rank = state["tensor_parallel"][0]
        kv_bytes = rank["kv_bytes"]
        assert kv_bytes >= KVCache.bytes_per_token(30, 3, 64, torch.bfloat16) * rank["kv_pool_tokens"]
        stream = engine.open_stream(TEXT, long)
        first = await stream.__anext__()
        held = rss()
        await engine.release_memory_occupation()
        dropped = held - rss()
        # every KV buffer and every weight form returned to the OS (5%: other heap fragments)
        assert dropped >= 0.95 * (kv_bytes + rank["weight_bytes"]), (dropped, kv_bytes, rank["weight_bytes"])
        state = await engine.get_internal_state()
        assert state["running_requests"] == 0  # retracted: back in the queue, not lost
        late = asyncio.ensure_future(engine.generate(TEXT, sp))
        steps = len(engine.recent_steps())
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not late.done() and len(engine.recent_steps()) == steps
        await engine.resume_memory_occupation()
        tail = [d async for d in stream]
        assert sum(len(d.token_ids) for d in [first, *tail]) == 48
        assert tail[-1].finish_reason == "length"
        assert (await late).token_ids == before.token_ids
        assert (await engine.generate(TEXT, sp)).token_ids == before.token_ids
        state = await engine.get_internal_state()
        assert state["available_tokens"] + state["evictable_tokens"] == state["total_tokens"]


async def test_tags_one_at_a_time_and_weights_come_back_from_disk(checkpoints):
    want_a, want_b = hf_greedy(checkpoints["a"]), hf_greedy(checkpoints["b"])
    async with Engine(checkpoints["a"], dtype="float32", max_total_tokens=4096) as engine:
        for tags in (["kv_cache"], ["weights"], ["weights", "kv_cache"]):
            await engine.release_memory_occupation(tags)
            await engine.resume_memory_occupation(tags)
            assert await greedy(engine) == want_a
        # weights from tensors are not kept over a release: resume loads the last checkpoint
        await engine.update_weights_from_tensor(hf_named_tensors(checkpoints["b"]), weight_version="t1")
        assert await greedy(engine) == want_b
        await engine.release_memory_occupation(["weights"])
        with pytest.raises(InvalidRequestError, match="released"):
            await engine.update_weights_from_tensor(hf_named_tensors(checkpoints["b"]))
        await engine.resume_memory_occupation(["weights"])
        assert engine.model_info.weight_version == "default"
        assert await greedy(engine) == want_a
        # a checkpoint loaded while released brings the weights back too
        await engine.release_memory_occupation()
        await engine.update_weights_from_disk(checkpoints["b"], weight_version="d2")
        await engine.resume_memory_occupation(["kv_cache"])
        assert await greedy(engine) == want_b
        for bad in ([], ["gpu"], ["kv_cache", "everything"]):
            with pytest.raises(InvalidRequestError) as info:
                await engine.release_memory_occupation(bad)
            assert info.value.param == "tags"
