"""An `Engine` stopped and started again over its loaded model (engine/scheduler/restart.py).

`generate_batch` starts and stops the engine's actors once per call, and `async with engine:`
blocks may follow one another. Before restart.py, each start built an empty prefix cache while
the runner's KV pool still held the last run's cached prefixes: the slots had no owner, and the
second call of any prompt crashed the scheduler at its idle memory check.

- Three `generate_batch` calls in a row: each succeeds with greedy tokens equal to the first
  call's, the repeated prompt hits the prefix cached by the earlier call, and the memory
  invariant holds after each (every slot free or in the tree).
- A run stopped while its requests are still decoding: the next start finds every slot and row
  free and serves normally.
- Under tensor parallelism a stop ends the group; the next call starts a new one.
"""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, SamplingParams

PROMPT = [(37 * i + 11) % 40000 for i in range(32)]
OTHER = [(53 * i + 7) % 40000 for i in range(20)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return Engine("smollm2-135m", dtype="float32", device="cpu", max_total_tokens=2048)


def memory(engine: Engine) -> dict:
    async def state() -> dict:
        async with engine:
            return await engine.get_internal_state()

    return asyncio.run(state())


def test_generate_batch_calls_share_the_prefix_cache(engine):
    first = engine.generate_batch([PROMPT], GREEDY)[0]
    assert first.error is None and first.cached_tokens == 0 and len(first.token_ids) == 8
    second = engine.generate_batch([PROMPT, OTHER], GREEDY)
    assert [r.error for r in second] == [None, None] and engine.death_reason is None
    assert second[0].token_ids == first.token_ids
    assert second[0].cached_tokens == len(PROMPT) - 1  # all but the last prompt token, cached by call one
    third = engine.generate_batch([OTHER], GREEDY)[0]
    assert third.token_ids == second[1].token_ids and third.cached_tokens == len(OTHER) - 1
    state = memory(engine)
    assert state["running_requests"] == 0 and state["protected_tokens"] == 0
    assert state["available_tokens"] + state["evictable_tokens"] == state["total_tokens"]
    assert state["evictable_tokens"] > 0  # the cache lives on


def test_a_stop_mid_run_frees_everything_for_the_next_start(engine):
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)

    async def stop_while_decoding() -> int:
        async with engine:
            stream = engine.open_stream(OTHER, long)
            got = 0
            async for delta in stream:
                got += len(delta.token_ids)
                if got >= 3:  # decoding: it holds a row and slots
                    break
            return got

    assert asyncio.run(stop_while_decoding()) >= 3
    state = memory(engine)  # a fresh start: nothing held, nothing cached
    assert state["available_tokens"] == state["total_tokens"] and state["evictable_tokens"] == 0
    again = engine.generate_batch([PROMPT], GREEDY)[0]
    assert again.error is None and engine.death_reason is None and len(again.token_ids) == 8


def test_a_tensor_parallel_engine_serves_a_second_call():
    """Stopping ends the tensor-parallel group (its worker ranks exit): the next start loads a new
    one instead of driving rank 0's runner on a destroyed group."""
    engine = Engine("smollm2-135m", dtype="float32", device="cpu", tp_size=3, torch_threads=1, max_total_tokens=2048)
    first = engine.generate_batch([PROMPT], GREEDY)[0]
    second = engine.generate_batch([PROMPT], GREEDY)[0]
    assert first.error is None and second.error is None and engine.death_reason is None
    assert second.token_ids == first.token_ids and len(first.token_ids) == 8
