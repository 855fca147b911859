"""Retraction under sustained memory pressure, on a tiny real model driven by `SyncScheduler`.

Many long `ignore_eos` decodes share a pool that holds about half of what they will need. The
scheduler must retract (engine/scheduler/retraction.py) without cycling:
- a retraction leaves the requests still running room for `RETRACT_DECODE_STEPS` more tokens each;
- a retracted request is re-admitted only when it fits beside the running ones: its own cached KV,
  which its admission locks, is no room for it (`PrefillAdder.locked_prefix_tokens`), and a
  request that does not fit waits instead of being admitted first in its round
  (`Scheduler.overcommits`);
- no request is sent back twice while others never were (the victim order).
`new_token_ratio` returns to its initial value once the engine idles. Outputs stay
token-identical (fp32 greedy) to running each request alone.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from engine import SamplingParams, SyncScheduler
from engine.scheduler.policy import PrefillAdder
from engine.scheduler.retraction import INIT_NEW_TOKEN_RATIO, RETRACT_DECODE_STEPS
from engine.scheduler.scheduler import Scheduler
from tests.sched_harness import make_runner, make_tiny_llama, new_req, random_prompts

MAX_STEPS = 3000  # every workload here idles within ~600 steps; a retract/re-admit loop never does


class Workload(NamedTuple):
    n: int
    prompt_lens: tuple[int, int]
    max_new: int
    pool: int
    chunk: int | None
    seed: int

    def requests(self) -> tuple[list[list[int]], SamplingParams]:
        prompts = random_prompts(self.n, *self.prompt_lens, seed=self.seed)
        return prompts, SamplingParams(temperature=0.0, max_new_tokens=self.max_new, ignore_eos=True)


# ~1400 tokens of need in a 720-token pool: several requests are retracted.
MIXED = Workload(16, (10, 40), 60, 720, 64, seed=3)
# Look-alike requests: the victim order decides who goes back (least progress alone would pick
# a request just re-admitted again).
ALIKE = Workload(16, (30, 35), 80, 896, None, seed=0)
# Long prompts, two fit at a time: a retracted request re-admitted onto its own cached KV, or a
# request admitted past the budget, used to retract and re-admit forever.
LONG = Workload(4, (300, 350), 80, 736, 64, seed=4)

CASES = [  # workload, overlap, radix, page size
    (MIXED, False, True, 1),
    (MIXED, True, False, 1),
    (MIXED, False, True, 16),
    (MIXED, True, True, 16),
    (ALIKE, True, True, 1),
    (LONG, True, True, 1),
    (LONG, False, True, 16),
]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def alone(tiny_folder):
    """Each request of a workload by itself in an ample pool: the reference, computed once."""
    cache: dict[Workload, list[list[int]]] = {}
    runner, args = make_runner(tiny_folder, disable_radix_cache=True)

    def outputs(w: Workload) -> list[list[int]]:
        if w not in cache:
            prompts, params = w.requests()
            cache[w] = []
            for i, p in enumerate(prompts):
                sched = SyncScheduler(runner, args)
                req = new_req(i, p, params)
                sched.add(req)
                sched.run_until_idle()
                cache[w].append(req.output_ids)
        return cache[w]

    return outputs


def page_ceil(n: int, page: int) -> int:
    return -(-n // page) * page


def watch_decode_rounds(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Record every decode round's `new_token_ratio`, and for each round that retracted and left
    more than one request running: (room, need) where need is what those requests take to grow
    by `RETRACT_DECODE_STEPS` tokens each (fewer if they finish sooner)."""
    seen: dict[str, list] = {"headroom": [], "ratios": []}
    real = Scheduler.update_running_batch

    def update_running_batch(self: Scheduler, batch):
        before = self.num_retractions
        out = real(self, batch)
        seen["ratios"].append(self.new_token_ratio)
        if out is not None and self.num_retractions > before and len(out.reqs) > 1:
            # This round's token is allocated already: what is left must cover the other steps.
            page, need = self.page_size, 0
            for r in out.reqs:
                grow = max(1, min(RETRACT_DECODE_STEPS, r.sampling_params.max_new_tokens - len(r.output_ids)))
                now = r.kv_committed_len  # this round's token included
                need += page_ceil(now - 1 + grow, page) - page_ceil(now, page)
            seen["headroom"].append((self.allocator.available_size() + self.tree_cache.evictable_size(), need))
        return out

    monkeypatch.setattr(Scheduler, "update_running_batch", update_running_batch)
    return seen


def case_id(case: tuple) -> str:
    w, overlap, radix, page = case
    name = {MIXED: "mixed", ALIKE: "alike", LONG: "long"}[w]
    return f"{name}-{'overlap' if overlap else 'sync'}-{'radix' if radix else 'noradix'}-page{page}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_sustained_pressure_retracts_each_request_at_most_once(alone, tiny_folder, monkeypatch, case):
    w, overlap, radix, page = case
    prompts, params = w.requests()
    opts = dict(max_total_tokens=w.pool, chunked_prefill_size=w.chunk, disable_radix_cache=not radix, page_size=page)
    runner, args = make_runner(tiny_folder, **opts)
    sched = SyncScheduler(runner, args)
    seen = watch_decode_rounds(monkeypatch)
    reqs = [new_req(i, p, params) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    sched.run_until_idle(overlap=overlap, max_steps=MAX_STEPS)
    s = sched.scheduler

    if w is MIXED:  # the pressure is real
        assert s.num_retractions > 0 and seen["headroom"]
        assert max(seen["ratios"]) > INIT_NEW_TOKEN_RATIO
    # (a) No retract -> re-admit -> retract cycle: `epoch` counts a request's retractions.
    times = {r.rid: r.epoch for r in reqs if r.epoch}
    assert max(times.values(), default=0) <= 1, f"retracted more than once: {times}"
    assert sum(times.values()) == s.num_retractions
    # (b) Every retraction left the others room for RETRACT_DECODE_STEPS more tokens each.
    for room, need in seen["headroom"]:
        assert room >= need, f"only {room} tokens of room after retracting, {need} needed"
    # (c) Idle again: the ratio the burst ended with is replaced by the initial one.
    assert seen["ratios"][-1] != INIT_NEW_TOKEN_RATIO
    assert s.new_token_ratio == INIT_NEW_TOKEN_RATIO
    # (d) Retraction never changes what a request generates.
    for i, r in enumerate(reqs):
        assert r.output_ids == alone(w)[i], f"request {i} differs (retracted {r.epoch}x)"
        assert r.finished_reason is not None and r.finished_reason.reason.value == "length"
    s.check_memory()


def test_admission_counts_the_prefix_it_locks_as_taken(tiny_folder):
    """A request whose prompt is cached (evictable) in the tree locks that prefix when admitted:
    the budget must not count those tokens as room for it. Planning leaves no lock behind."""
    runner, args = make_runner(tiny_folder, max_total_tokens=1024)
    sched = SyncScheduler(runner, args)
    prompt = random_prompts(1, 200, 200, seed=9)[0]
    sched.add(new_req(0, prompt, SamplingParams(temperature=0.0, max_new_tokens=4)))
    sched.run_until_idle()
    tree = sched.scheduler.tree_cache
    cached = tree.evictable_size()
    params = SamplingParams(temperature=0.0, max_new_tokens=20)

    def adder_with(extra: int) -> tuple[PrefillAdder, bool]:
        other = new_req(1, random_prompts(1, 10, 10, seed=10)[0], params)  # nothing cached: 10 + 20
        again = new_req(2, prompt, params)  # all but its last prompt token cached: 1 + 20
        adder = PrefillAdder(tree, 1, 30 + 21 + extra, rem_input_tokens=4096, rem_chunk_tokens=None, max_new_reqs=8)
        assert adder.add_one_req(other)
        admitted = adder.add_one_req(again)
        assert len(again.prefix_indices) == len(prompt) - 1
        assert tree.evictable_size() == cached and tree.protected_size() == 0
        return adder, admitted

    _, admitted = adder_with(len(prompt) - 2)  # room for it only if its own prefix were free
    assert not admitted
    adder, admitted = adder_with(len(prompt) - 1)  # room for it beside the prefix it locks
    assert admitted and len(adder.can_run_list) == 2


def test_a_request_that_does_not_fit_beside_the_running_ones_waits(tiny_folder):
    """The planner admits the first request of a round past the total budget (so one larger than
    the free pool runs once nothing else does); while another request runs, the scheduler hands
    it back instead, so it is never admitted only to be retracted."""
    runner, args = make_runner(tiny_folder, max_total_tokens=512, chunked_prefill_size=None)
    sched = SyncScheduler(runner, args)
    first = new_req(0, random_prompts(1, 20, 20, seed=5)[0], SamplingParams(temperature=0.0, max_new_tokens=200))
    big = new_req(1, random_prompts(1, 250, 250, seed=6)[0], SamplingParams(temperature=0.0, max_new_tokens=150))
    sched.add(first)
    sched.step()  # `first` runs: 512 - 21 - 0.7 * 200 leaves ~350 tokens, `big` needs 400
    sched.add(big)
    sched.run_until_idle()
    assert sched.scheduler.num_retractions == 0
    assert max(step.batch_size for step in sched.steps) == 1  # `big` started once `first` was done
    assert len(first.output_ids) == 200 and len(big.output_ids) == 150
    sched.scheduler.check_memory()


def test_idle_reset_happens_when_the_engine_goes_idle_not_while_it_is(tiny_folder):
    """The reset is the busy -> idle edge: a ratio set while idle (`set_internal_state`) holds
    through idle rounds and is replaced only when the next burst ends."""
    runner, args = make_runner(tiny_folder, max_total_tokens=512)
    sched = SyncScheduler(runner, args)
    s = sched.scheduler
    s.new_token_ratio = 0.5
    assert sched.step() is None and sched.step() is None  # idle rounds
    assert s.new_token_ratio == 0.5
    sched.add(new_req(0, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=3)))
    sched.run_until_idle()
    assert s.new_token_ratio == INIT_NEW_TOKEN_RATIO
