"""The actor pipeline's wiring: the Dispatcher's routing table, and the PrefillAdder actor deciding
exactly what the synchronous step decides.

The equivalence runs the step-by-step scheduler scenarios (continuous batching with shared
prefixes, chunking, pages; retraction in a small pool; a request that never fits; prompts sharing a
head that arrive together) twice on the same tiny model: once through `SyncScheduler` (planner
called directly) and once through the `Engine`'s actors (planner behind the PrefillAdder's mailbox,
forwards on the device stream). Every batch the scheduler launches, with its requests' prefix and
extend lengths, must be the same, and so must every output.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from engine import Engine, SamplingParams, SyncScheduler
from engine.actors.dispatcher import REQUEST_INPUTS, Dispatcher, routing_table
from engine.actors.messages import (
    AbortAllReq,
    AbortReq,
    ContinueGenerationReq,
    FlushCacheReq,
    GetInternalStateReq,
    LoRAAdapterReq,
    MemoryOccupationReq,
    PauseGenerationReq,
    SetInternalStateReq,
    StopStrMatched,
    TokenizedGenerateReq,
    UpdateWeightsReq,
    WaitingCount,
    WeightGroupReq,
)
from engine.actors.overlap_scheduler import OverlapScheduler
from engine.actors.prefill_adder import PrefillAdderActor
from engine.actors.runtime import Actor
from engine.scheduler.scheduler import Scheduler
from tests.sched_harness import build_tiny_folder, make_runner, new_req, random_prompts

TIMEOUT = 120


class Sink(Actor):
    """Accepts what its real counterpart accepts and records it."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.got: list[msgspec.Struct] = []

    async def handle(self, msg: msgspec.Struct) -> None:
        self.got.append(msg)


class AdderSink(Sink):
    accepts = PrefillAdderActor.accepts


class SchedulerSink(Sink):
    accepts = OverlapScheduler.accepts


async def test_dispatcher_routes_each_type_to_its_actor():
    adder, scheduler = AdderSink("prefill_adder"), SchedulerSink("scheduler")
    dispatcher = Dispatcher(routing_table(adder, scheduler))
    msgs = [
        TokenizedGenerateReq("a", [1, 2], SamplingParams(), seed=1),
        AbortReq("a"),
        StopStrMatched("b", "END"),
        FlushCacheReq(1),
        GetInternalStateReq(2),
        SetInternalStateReq(3, {"new_token_ratio": 0.5}),
        UpdateWeightsReq(reply_id=4, model_path="/ckpt"),
        PauseGenerationReq(5, "retract"),
        ContinueGenerationReq(6),
        MemoryOccupationReq(7, True, ["kv_cache"]),
        WeightGroupReq(8, "destroy", {"group_name": "g"}),
        LoRAAdapterReq(9, "unload", "adapter"),
        AbortAllReq(),
    ]
    assert {type(m) for m in msgs} == set(REQUEST_INPUTS)  # every type the dispatcher accepts
    for actor in (adder, scheduler, dispatcher):
        actor.start()
    for m in msgs:
        dispatcher.send(m)
    async with asyncio.timeout(60):  # a hang guard, generous for a busy machine
        while len(adder.got) + len(scheduler.got) < len(msgs):
            await asyncio.sleep(0.001)
    # New requests go to the waiting queue's owner; everything about live requests and state to
    # the scheduler (which forwards what it does not hold), in order.
    assert adder.got == msgs[:1]
    assert scheduler.got == msgs[1:]
    for actor in (dispatcher, adder, scheduler):
        await actor.stop()
    with pytest.raises(TypeError, match="accepts"):
        Dispatcher(routing_table(adder, scheduler)).send(WaitingCount(1, 1))  # not a request-side message
    with pytest.raises(ValueError, match="no route"):
        Dispatcher({TokenizedGenerateReq: adder})


# ---- the PrefillAdder actor decides as the synchronous step does --------------------------------


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every batch any Scheduler launches: mode and, per request, (rid, prefix len, extend len)."""
    launches: list[tuple[Any, ...]] = []
    real = Scheduler.launched

    def launched(self: Scheduler, batch):
        if batch.forward_mode.is_extend():
            reqs = tuple((r.rid, len(r.prefix_indices), r.extend_input_len) for r in batch.reqs)
        else:
            reqs = tuple(r.rid for r in batch.reqs)
        launches.append((batch.forward_mode.name, reqs))
        return real(self, batch)

    monkeypatch.setattr(Scheduler, "launched", launched)
    return launches


def shared_prefix_prompts() -> list[list[int]]:
    groups = random_prompts(4, 200, 200, seed=11)
    return [groups[i // 6] + q for i, q in enumerate(random_prompts(24, 20, 20, seed=12))]


def mixed_prompts() -> list[list[int]]:
    prompts = random_prompts(40, 3, 150, seed=1)
    prompts[30:38] = [prompts[9][:60] + p[:20] for p in prompts[30:38]]
    return prompts


SCENARIOS = {
    # name: (prompts, max_new_tokens per request, engine options)
    "mixed-radix-chunk64": (mixed_prompts, lambda i: 4 + (i * 7) % 29, dict(chunked_prefill_size=64)),
    "mixed-pages16-nochunk": (mixed_prompts, lambda i: 4 + (i * 7) % 29, dict(chunked_prefill_size=None, page_size=16)),
    "mixed-noradix": (
        mixed_prompts,
        lambda i: 4 + (i * 7) % 29,
        dict(disable_radix_cache=True, chunked_prefill_size=64),
    ),
    "retraction": (
        lambda: random_prompts(16, 15, 25, seed=7),
        lambda i: 60,
        dict(max_total_tokens=800, chunked_prefill_size=64),
    ),
    "never-fits": (
        lambda: [list(range(200)), list(range(10))],
        lambda i: (400, 5)[i],
        dict(max_total_tokens=256, chunked_prefill_size=64),
    ),
    "in-batch-prefix": (shared_prefix_prompts, lambda i: 6, dict(chunked_prefill_size=256)),
}


@pytest.fixture(scope="module")
def tiny_tok_folder(tmp_path_factory, default_tokenizer):
    return build_tiny_folder(tmp_path_factory.mktemp("tiny-actor-pipeline"), default_tokenizer)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_prefill_adder_actor_decides_as_the_sync_step(tiny_tok_folder, monkeypatch, scenario, overlap):
    make_prompts, max_new, options = SCENARIOS[scenario]
    prompts = make_prompts()
    params = [SamplingParams(temperature=0.0, max_new_tokens=max_new(i), ignore_eos=True) for i in range(len(prompts))]
    opts = {"max_total_tokens": 8192, "max_running_requests": 64, **options}
    launches = record_launches(monkeypatch)

    runner, args = make_runner(tiny_tok_folder, **opts)
    sync = SyncScheduler(runner, args)
    reqs = [new_req(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs:
        sync.add(r)
    sync.run_until_idle(overlap=overlap)
    sync_launches, sync_outputs = list(launches), [r.output_ids for r in reqs]
    launches.clear()
    del sync, runner

    engine = Engine(tiny_tok_folder, dtype="float32", device="cpu", torch_threads=1, enable_overlap=overlap, **opts)
    async with engine:
        async with asyncio.timeout(TIMEOUT):
            # Submitted before any actor runs, as the synchronous run had them all queued at once.
            streams = [engine.open_stream(p, sp, rid=f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]

            async def collect(stream) -> list[int]:
                return [t async for d in stream for t in d.token_ids]

            actor_outputs = await asyncio.gather(*(collect(s) for s in streams))
        state = await engine.get_internal_state()
    assert state["memory_errors"] == []
    assert launches == sync_launches, f"first difference at launch {_first_diff(launches, sync_launches)}"
    assert actor_outputs == sync_outputs
    if scenario == "retraction":
        assert state["num_retractions"] > 0


def _first_diff(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
