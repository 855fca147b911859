"""Scheduler decisions, step by step on a tiny real model (no asyncio): continuous batching,
radix cache, chunked prefill, page sizes, retraction, overlap; outputs equal running alone."""

from __future__ import annotations

import itertools

import pytest

from engine import SamplingParams, SyncScheduler
from tests.sched_harness import make_runner, make_tiny_llama, new_req, random_prompts

N_REQS = 64


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def prompts_and_params():
    prompts = random_prompts(N_REQS, 3, 150, seed=1)
    # Shared prefixes so the radix cache has something to reuse.
    prompts[44:54] = [prompts[9][:60] + p[:20] for p in prompts[44:54]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=4 + (i * 7) % 29) for i in range(N_REQS)]
    return prompts, params


@pytest.fixture(scope="module")
def alone_outputs(tiny_folder):
    """Each request run by itself (no cache, no chunking): the reference."""
    prompts, params = prompts_and_params()
    runner, args = make_runner(tiny_folder, disable_radix_cache=True, chunked_prefill_size=None)
    outs = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        sched = SyncScheduler(runner, args)
        req = new_req(i, p, sp)
        sched.add(req)
        sched.run_until_idle(overlap=False)
        sched.scheduler.check_memory()
        outs.append(req.output_ids)
    return outs


COMBOS = list(itertools.product([True, False], [True, False], [64, None], [1, 16]))


@pytest.mark.parametrize("overlap,radix,chunk,page", COMBOS)
def test_batched_equals_alone(tiny_folder, alone_outputs, overlap, radix, chunk, page):
    prompts, params = prompts_and_params()
    runner, args = make_runner(tiny_folder, disable_radix_cache=not radix, chunked_prefill_size=chunk, page_size=page)
    sched = SyncScheduler(runner, args)
    reqs = [new_req(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for r in reqs[:40]:
        sched.add(r)
    late = iter(reqs[40:])

    def add_late(step: int) -> None:  # the rest arrive while the first ones decode
        if step % 2 == 0:
            r = next(late, None)
            if r is not None:
                sched.add(r)

    sched.run_until_idle(overlap=overlap, on_step=add_late)
    for r in late:  # any not yet added (cannot happen with these sizes, but be exact)
        sched.add(r)
    sched.run_until_idle(overlap=overlap)
    for i, r in enumerate(reqs):
        assert r.output_ids == alone_outputs[i], f"request {i} differs"
        assert r.finished_reason is not None and r.finished_reason.reason.value == "length"
    sched.scheduler.check_memory()
    if radix:
        assert sched.scheduler.hit_tokens > 0


def test_retraction_with_small_pool(tiny_folder):
    """Running decodes outgrow a pool sized for ~60% of their total need: requests are retracted,
    re-prefilled later, and still produce exactly what they produce alone."""
    prompts = random_prompts(16, 15, 25, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=60)
    alone = []
    runner, args = make_runner(tiny_folder)
    for i, p in enumerate(prompts):
        sched = SyncScheduler(runner, args)
        req = new_req(i, p, params)
        sched.add(req)
        sched.run_until_idle(overlap=False)
        alone.append(req.output_ids)
    for overlap, radix in ((False, True), (True, True), (True, False)):
        runner, args = make_runner(
            tiny_folder, max_total_tokens=800, chunked_prefill_size=64, disable_radix_cache=not radix
        )
        sched = SyncScheduler(runner, args)
        reqs = [new_req(i, p, params) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)
        sched.run_until_idle(overlap=overlap)
        assert sched.scheduler.num_retractions > 0
        for i, r in enumerate(reqs):
            assert r.output_ids == alone[i], f"request {i} differs after retraction (overlap={overlap})"
        sched.scheduler.check_memory()


def test_request_larger_than_pool_is_aborted(tiny_folder):
    runner, args = make_runner(tiny_folder, max_total_tokens=256, chunked_prefill_size=64)
    sched = SyncScheduler(runner, args)
    big = new_req(0, list(range(200)), SamplingParams(temperature=0.0, max_new_tokens=400))
    small = new_req(1, list(range(10)), SamplingParams(temperature=0.0, max_new_tokens=5))
    sched.add(big)
    sched.add(small)
    sched.run_until_idle(overlap=True)
    assert big.finished_reason.reason.value == "abort"
    assert "does not fit" in big.finished_reason.message
    assert len(small.output_ids) == 5
    sched.scheduler.check_memory()


@pytest.mark.parametrize("overlap,chunk", [(True, 256), (False, 256), (True, None)])
def test_shared_prefix_arriving_together_is_computed_once(tiny_folder, overlap, chunk):
    """4 groups x 6 requests (200-token group prefix + 20-token question) arrive at once: with
    in-batch prefix sharing each group's prefix is prefilled once, the other members wait for
    it to reach the tree and then extend only their question. Outputs equal running alone."""
    groups = random_prompts(4, 200, 200, seed=11)
    questions = random_prompts(24, 20, 20, seed=12)
    prompts = [groups[i // 6] + q for i, q in enumerate(questions)]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    runner, args = make_runner(tiny_folder, chunked_prefill_size=chunk)
    alone = []
    for i, p in enumerate(prompts[:6]):
        sched = SyncScheduler(runner, args)
        req = new_req(i, p, params)
        sched.add(req)
        sched.run_until_idle(overlap=False)
        alone.append(req.output_ids)
        assert sched.scheduler.flush_cache()  # the runner's pool is shared with the next scheduler
    sched = SyncScheduler(runner, args)
    reqs = [new_req(i, p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    computed = []

    def count_prefill_tokens(batch):
        if batch.forward_mode.is_extend():
            computed.append(sum(batch.extend_seq_lens))

    sched.on_forward = count_prefill_tokens
    sched.run_until_idle(overlap=overlap)
    # Each prefix once, each question once (plus at most one page of re-computed tail per request).
    assert sum(computed) <= 4 * 200 + 24 * 20 + 24, computed
    assert sched.scheduler.hit_tokens >= 20 * 200
    for i in range(6):
        assert reqs[i].output_ids == alone[i]
    sched.scheduler.check_memory()
