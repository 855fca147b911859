"""Mixed chunked prefill (`enable_mixed_chunk`, issue 17 item 1): running requests decode inside
a prefill chunk's forward (ForwardMode.MIXED). fp32 greedy outputs equal running alone, with and
without overlap, radix cache and pages; memory is whole after retractions and aborts."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams, SyncScheduler
from engine.recorder.replay import replay
from tests.sched_harness import make_runner, new_req, random_prompts
from tests.test_engine import tiny_engine, tiny_tok_folder  # noqa: F401  (the fixture)
from tests.test_scheduler import alone_outputs, prompts_and_params, tiny_folder  # noqa: F401  (fixtures)


@pytest.mark.parametrize(
    "overlap,radix,page", [(False, True, 1), (True, True, 1), (True, False, 16), (False, True, 16)]
)
def test_mixed_equals_alone(tiny_folder, alone_outputs, overlap, radix, page):
    prompts, params = prompts_and_params()
    runner, args = make_runner(
        tiny_folder, disable_radix_cache=not radix, chunked_prefill_size=64, page_size=page, enable_mixed_chunk=True
    )
    sched = SyncScheduler(runner, args)
    reqs = [new_req(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs[:8]:
        sched.add(r)
    late = iter(reqs[8:])

    def add_late(step: int) -> None:  # arrivals while others decode: their chunks mix with decodes
        for _ in range(2):
            if (r := next(late, None)) is not None:
                sched.add(r)

    sched.run_until_idle(overlap=overlap, on_step=add_late)
    modes = [s.mode for s in sched.steps]
    assert "MIXED" in modes, modes
    for i, r in enumerate(reqs):
        assert r.output_ids == alone_outputs[i], f"request {i} differs"
    sched.scheduler.check_memory()
    mixed = [s for s in sched.steps if s.mode == "MIXED"]
    assert all(s.num_tokens <= 64 for s in mixed), "decode tokens count against the chunk budget"


def test_mixed_retraction_and_abort_keep_memory_whole(tiny_folder):
    prompts = random_prompts(16, 15, 90, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    runner, args = make_runner(tiny_folder, chunked_prefill_size=32)
    alone = []
    for i, p in enumerate(prompts):
        sched = SyncScheduler(runner, args)
        req = new_req(i, p, params)
        sched.add(req)
        sched.run_until_idle()
        alone.append(req.output_ids)
    for overlap in (False, True):
        runner, args = make_runner(tiny_folder, max_total_tokens=800, chunked_prefill_size=32, enable_mixed_chunk=True)
        sched = SyncScheduler(runner, args)
        reqs = [new_req(i, p, params) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)

        def abort_one(step: int, sched: SyncScheduler = sched, rid: str = reqs[3].rid) -> None:
            if step == 12:
                sched.abort(rid)

        sched.run_until_idle(overlap=overlap, on_step=abort_one)
        assert sched.scheduler.num_retractions > 0
        assert "MIXED" in {s.mode for s in sched.steps}
        for i, r in enumerate(reqs):
            if i != 3:
                assert r.output_ids == alone[i], f"request {i} differs (overlap={overlap})"
        assert reqs[3].finished_reason.reason.value == "abort"
        sched.scheduler.check_memory()


async def test_engine_mixed_chunk_overlap_replays(tiny_tok_folder, tmp_path):
    """Through the actors (overlap on and off): outputs equal the unmixed engine's, and the flight
    recorder's dump of a mixed run replays with no divergence."""
    prompts = random_prompts(24, 20, 200, seed=3)
    params = [SamplingParams(temperature=0.0, max_new_tokens=5 + i % 13, ignore_eos=True) for i in range(24)]

    async def run(**kw):
        async with tiny_engine(tiny_tok_folder, chunked_prefill_size=48, flight_recorder_dir=str(tmp_path), **kw) as e:
            outs = [asyncio.ensure_future(e.generate(p, sp)) for p, sp in zip(prompts[:4], params)]
            await asyncio.sleep(0.05)  # the rest arrive while the first ones decode
            outs += [asyncio.ensure_future(e.generate(p, sp)) for p, sp in zip(prompts[4:], params[4:])]
            results = [r.token_ids for r in await asyncio.gather(*outs)]
            modes = {s.mode for s in e.recent_steps()}
            return results, modes, e.dump_flight_recorder()

    plain, _, _ = await run()
    for overlap in (False, True):
        mixed, modes, dump = await run(enable_mixed_chunk=True, enable_overlap=overlap)
        assert "MIXED" in modes
        assert mixed == plain
        report = replay(dump)
        assert report.divergence is None, report.divergence.describe()
