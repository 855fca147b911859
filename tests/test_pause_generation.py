"""Pause / continue generation in SGLang's three modes, with requests streaming: none lost, token
counts exact, greedy outputs unchanged by the pause; a weight update while paused is reported in
each output's weight versions; abort_all ends running and waiting requests."""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine, InvalidRequestError, SamplingParams
from engine.api import ResultBuilder
from tests.sched_harness import build_tiny_folder
from tests.weight_helpers import perturbed_copy

PROMPTS = [[5, 17, 99, 3, 250, 7], [1200, 44, 9, 9, 31], [77] * 12, [3, 1, 4, 1, 5, 9, 2, 6]]
NEW = 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_tokenizer) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("pause")
    a = build_tiny_folder(root / "a", default_tokenizer)
    return a, perturbed_copy(a, root / "b", seed=2)


def params() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)


async def collect(stream, first=None) -> ResultBuilder:
    built = ResultBuilder()
    if first is not None:
        built.add(first)
    async for delta in stream:
        built.add(delta)
    return built


async def started(engine: Engine) -> list[asyncio.Future]:
    """Every prompt streaming, each past its first token; a task per stream collecting the rest."""
    streams = [engine.open_stream(p, params()) for p in PROMPTS]
    firsts = [await s.__anext__() for s in streams]
    return [asyncio.ensure_future(collect(s, first)) for first, s in zip(firsts, streams)]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_pause_and_continue_lose_nothing(folders, mode):
    async with Engine(folders[0], dtype="float32", max_total_tokens=4096) as engine:
        want = [r.token_ids for r in await asyncio.gather(*(engine.generate(p, params()) for p in PROMPTS))]
        await engine.flush_cache()
        tasks = await started(engine)
        await engine.pause_generation(mode)
        state = await engine.get_internal_state()
        held_while_paused = state["running_requests"]
        # paused: nothing runs, even a new request only queues
        late = asyncio.ensure_future(engine.generate(PROMPTS[0], params()))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not late.done() and not any(t.done() for t in tasks)
        steps_before = len(engine.recent_steps())
        await asyncio.sleep(0.05)
        assert len(engine.recent_steps()) == steps_before
        await engine.continue_generation()
        results = await asyncio.gather(*tasks)
        assert [r.token_ids for r in results] == want
        assert all(r.last.finish_reason == "length" and r.last.completion_tokens == NEW for r in results)
        assert (await late).token_ids == want[0]
        if mode == "retract":
            assert held_while_paused == 0
        else:
            assert held_while_paused == len(PROMPTS)


async def test_pause_abort_ends_running_and_waiting(folders):
    async with Engine(folders[0], dtype="float32", max_total_tokens=4096, max_running_requests=2) as engine:
        streams = [engine.open_stream(p, params()) for p in PROMPTS]  # two run, two wait
        await streams[0].__anext__()
        await engine.pause_generation("abort")
        ends = [(await collect(s)).last for s in streams]
        assert all(e is not None and e.finish_reason == "abort" for e in ends)
        state = await engine.get_internal_state()
        assert state["running_requests"] == 0 and state["waiting_requests"] == 0
        await engine.continue_generation()
        assert len((await engine.generate(PROMPTS[1], params())).token_ids) == NEW
        with pytest.raises(InvalidRequestError) as info:
            await engine.pause_generation("sideways")
        assert info.value.param == "mode"


async def test_abort_all_ends_every_request(folders):
    async with Engine(folders[0], dtype="float32", max_total_tokens=4096, max_running_requests=2) as engine:
        streams = [engine.open_stream(p, params()) for p in PROMPTS]
        await streams[0].__anext__()
        await engine.abort_all()
        ends = [(await collect(s)).last for s in streams]
        assert [e.finish_reason for e in ends] == ["abort"] * len(PROMPTS)
        state = await engine.get_internal_state()
        assert state["running_requests"] == 0 and state["waiting_requests"] == 0
        assert state["available_tokens"] + state["evictable_tokens"] == state["total_tokens"]


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_update_while_paused_is_reported_in_weight_versions(folders, mode):
    """The RL loop: pause, new weights, continue. The paused requests' tokens span two versions,
    and each output says so; none is lost, none repeated."""
    a, b = folders
    async with Engine(a, dtype="float32", max_total_tokens=4096) as engine:
        tasks = await started(engine)
        await engine.pause_generation(mode)
        assert await engine.update_weights_from_disk(b, weight_version="v2") == "v2"
        await engine.continue_generation()
        results = await asyncio.gather(*tasks)
        for r in results:
            assert len(r.token_ids) == NEW and r.last.completion_tokens == NEW
            assert r.weight_versions == ["default", "v2"]
        fresh = await engine.generate(PROMPTS[0], params())
        assert fresh.weight_versions == ["v2"]
        state = await engine.get_internal_state()
        assert state["available_tokens"] + state["evictable_tokens"] == state["total_tokens"]
