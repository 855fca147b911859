"""Hybrid SWA memory (issue 31): sliding-window layers hold only the KV they can still read.

- The allocator's two slot spaces, releases, reclaims and pages, on their own.
- A Mistral-shaped model (every layer windowed): a long prompt and a long generation hold at most
  a window (plus the release stride and a prefill chunk) of SWA slots at any step, where the plain
  pool holds every position; tokens equal transformers' in fp32 either way.
- Released KV is cache: a later prompt sharing the prefix reuses it, and a chat's next turn reuses
  the whole conversation. With a SWA pool too small for everyone, released slots are reclaimed
  (tombstoned), a later match is cut to a live window, tokens still equal transformers'.
- Gemma 3 (local and global layers): two buffer sizes, the same tokens.
- The async engine with overlap over a pool that must reclaim: transformers' tokens, and the
  flight recorder's dump replays with zero divergences.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig

from engine import Engine, SyncScheduler
from engine.cache.swa_pool import RELEASE_STRIDE, SWATokenToKVPoolAllocator
from engine.cache.swa_radix_cache import SWARadixCache, live_prefix_len
from engine.distributed.driver import TPDriver
from engine.model_executor.model_runner import ModelRunner
from engine.recorder.replay import replay
from engine.sampling import SamplingParams
from server.cli import parse_args
from tests.test_model_families import COMMON, family_args, save_random_model
from tests.test_model_windows import GEMMA3_LAYERS, GEMMA_INIT, PLAIN_INIT

WINDOW, CHUNK = 16, 32


def hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    inp = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-swa")
    cfg = MistralConfig(**(COMMON | dict(max_position_embeddings=1024)), sliding_window=WINDOW)
    hf = save_random_model(cfg, PLAIN_INIT, folder)
    return str(folder), hf


def runner_for(folder: str, **kw) -> ModelRunner:
    return ModelRunner(family_args(folder, chunked_prefill_size=CHUNK, **kw))


# ---- the allocator ----------------------------------------------------------------------------


def test_allocator_releases_reclaims_and_frees_both_slots():
    alloc = SWATokenToKVPoolAllocator(full_size=65, swa_size=17, window=4)
    assert (alloc.full.size, alloc.swa.size, alloc.size) == (64, 16, 16)
    a = alloc.alloc(10)
    assert alloc.live(a).all() and alloc.available_size() == 6
    assert alloc.release(a[:6]) == 6 and alloc.release(a[:6]) == 0  # idempotent
    assert alloc.available_size() == 12 and alloc.swa_held() == 4
    b = alloc.alloc(9)  # 6 free SWA slots: the 3 oldest released ones are reclaimed (tombstoned)
    assert b is not None and alloc.live(a[:3]).logical_not().all() and alloc.live(a[3:]).all()
    alloc.unrelease(a[3:6])  # a match will read these: no longer reclaimable
    assert alloc.num_released == 0 and alloc.available_size() == 0
    assert alloc.alloc(1) is None and alloc.full.available_size() == 64 - 19  # nothing half taken
    alloc.free(a)
    alloc.free(b)
    assert alloc.full.available_size() == 64 and alloc.swa.available_size() == 16
    assert int(alloc.full_to_swa.count_nonzero()) == 0 and alloc.idle_error(torch.empty(0, dtype=torch.int64)) is None


def test_paged_allocator_keeps_page_offsets_in_both_pools():
    alloc = SWATokenToKVPoolAllocator(full_size=68, swa_size=36, window=8, page_size=4)
    first = alloc.alloc(6)  # two pages, the second half used
    more = alloc.alloc_extend(int(first[-1]), 6, 5)  # the page's tail, then a fresh page
    slots = torch.cat([first, more])
    swa = alloc.full_to_swa[slots]
    assert torch.equal(slots % 4, swa % 4) and torch.equal(swa[6:8], swa[5] + torch.tensor([1, 2]))
    assert alloc.release(slots[:4]) == 4  # a whole page
    alloc.unrelease(slots[1:2])  # takes its whole page back
    assert alloc.num_released == 0
    alloc.free_extend(more, 6)  # frees only the fresh page
    assert alloc.live(slots[:8]).all() and not alloc.live(slots[8:]).any()


def test_live_prefix_len_ends_on_a_live_window():
    live = torch.tensor([False] * 10 + [True] * 10)
    assert live_prefix_len(live, 4, 1) == 20
    assert live_prefix_len(live, 12, 1) == 0  # no 12 live positions in a row ending anywhere
    live[17] = False
    assert live_prefix_len(live, 4, 1) == 17 and live_prefix_len(live, 4, 4) == 16
    assert live_prefix_len(live, 8, 1) == 0 and live_prefix_len(live, 2, 1) == 20
    assert live_prefix_len(torch.ones(7, dtype=torch.bool), 16, 1) == 7  # shorter than a window


# ---- the engine ---------------------------------------------------------------------------------


def run_tracking_swa(sched: SyncScheduler) -> list[int]:
    """Run until idle; the SWA slots held (not reclaimable) after each step."""
    held: list[int] = []
    sched.run_until_idle(on_step=lambda step: held.append(sched.scheduler.allocator.swa_held()))
    return held


def test_long_request_holds_a_window_of_swa_kv(mistral):
    folder, hf = mistral
    prompt, new = prompt_of(300, 1), 200
    runner = runner_for(folder)
    alloc = runner.token_to_kv_pool_allocator
    assert isinstance(alloc, SWATokenToKVPoolAllocator) and set(runner.kv_cache.layer_sizes) == {alloc.swa.size + 1}
    sched = SyncScheduler(runner, runner.args)
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new))
    held = run_tracking_swa(sched)
    assert req.output_ids == hf_generate(hf, prompt, new)
    # per step: the window, what may wait for the next release, and the chunk being prefilled
    assert max(held) <= WINDOW + RELEASE_STRIDE + CHUNK, max(held)
    assert max(held) < len(prompt) // 2 and len(held) >= new
    sched.scheduler.check_memory()  # idle: every SWA slot in use is a live slot of the tree

    plain = runner_for(folder, disable_hybrid_swa_memory=True)
    assert not isinstance(plain.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    sched = SyncScheduler(plain, plain.args)
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new))
    used = []
    sched.run_until_idle(on_step=lambda step: used.append(plain.token_to_kv_pool_allocator.available_size()))
    assert plain.token_to_kv_pool_allocator.size - min(used) >= len(prompt) + new - 1  # the whole sequence
    assert req.output_ids == hf_generate(hf, prompt, new)


def test_paged_pool_releases_whole_pages(mistral):
    """Pages of 4: releases, reclaims and radix matches in whole pages; tokens stay transformers'."""
    folder, hf = mistral
    runner = runner_for(folder, page_size=4, max_total_tokens=1024, swa_full_tokens_ratio=0.25)
    alloc = runner.token_to_kv_pool_allocator
    sched = SyncScheduler(runner, runner.args)
    shared = prompt_of(44, 8)
    prompts = [shared + prompt_of(30 + 9 * i, 40 + i) for i in range(3)] + [prompt_of(150, 9)]
    reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=90)) for p in prompts]
    held = run_tracking_swa(sched)
    for req, prompt in zip(reqs, prompts):
        assert req.output_ids == hf_generate(hf, prompt, 90)
    assert max(held) <= alloc.swa.size and alloc.swa_used() % 4 == 0
    sched.scheduler.check_memory()
    late = shared + prompt_of(20, 50)
    req = sched.add_request(late, SamplingParams(temperature=0.0, max_new_tokens=30))
    sched.run_until_idle()
    assert req.output_ids == hf_generate(hf, late, 30) and req.cached_tokens % 4 == 0
    sched.scheduler.check_memory()


def test_released_kv_serves_a_shared_prefix_and_the_next_turn(mistral):
    folder, hf = mistral
    runner = runner_for(folder)
    sched = SyncScheduler(runner, runner.args)
    assert isinstance(sched.scheduler.tree_cache, SWARadixCache)
    system = prompt_of(40, 2)
    params = SamplingParams(temperature=0.0, max_new_tokens=120)
    first = sched.add_request(system + prompt_of(20, 3), params)
    sched.run_until_idle()
    assert runner.token_to_kv_pool_allocator.num_released > 0  # the system prompt left the window
    other = system + prompt_of(20, 4)
    second = sched.add_request(other, params)
    sched.run_until_idle()
    assert second.cached_tokens >= len(system) and second.output_ids == hf_generate(hf, other, 120)
    turn2 = first.origin_input_ids + first.output_ids + prompt_of(12, 5)
    third = sched.add_request(turn2, SamplingParams(temperature=0.0, max_new_tokens=20))
    sched.run_until_idle()
    assert third.cached_tokens >= len(turn2) - 12 - 1  # the whole first conversation
    assert third.output_ids == hf_generate(hf, turn2, 20)
    sched.scheduler.check_memory()


def test_a_small_swa_pool_reclaims_released_kv(mistral):
    """Four long requests at once in a SWA pool that holds two of them: releases are reclaimed,
    matches are cut to a live window, tokens stay transformers'."""
    folder, hf = mistral
    runner = runner_for(folder, max_total_tokens=1200, swa_full_tokens_ratio=0.25)
    alloc = runner.token_to_kv_pool_allocator
    assert alloc.swa.size == 300
    sched = SyncScheduler(runner, runner.args)
    shared = prompt_of(48, 6)
    prompts = [shared + prompt_of(40 + 10 * i, 10 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_new_tokens=80)
    reqs = [sched.add_request(p, params) for p in prompts]
    held = run_tracking_swa(sched)
    assert max(held) <= alloc.swa.size
    for req, prompt in zip(reqs, prompts):
        assert req.output_ids == hf_generate(hf, prompt, 80)
    assert int((~alloc.live(sched.scheduler.tree_cache.all_values())).sum()) > 0  # tombstones in the tree
    late = shared + prompt_of(30, 20)
    req = sched.add_request(late, params)
    sched.run_until_idle()
    assert req.output_ids == hf_generate(hf, late, 80)
    sched.scheduler.check_memory()


def test_gemma3_global_and_local_layers_get_their_pools(tmp_path):
    cfg = Gemma3TextConfig(**(COMMON | GEMMA3_LAYERS), head_dim=16, sliding_window=10, query_pre_attn_scalar=16)
    hf = save_random_model(cfg, GEMMA_INIT, tmp_path)
    runner = runner_for(str(tmp_path), max_total_tokens=1000)
    alloc = runner.token_to_kv_pool_allocator
    assert isinstance(alloc, SWATokenToKVPoolAllocator)
    assert [b.shape[0] for b in runner.kv_cache.k_buffer] == [801, 801, 1001]  # + the padding slot
    sched = SyncScheduler(runner, runner.args)
    prompt = prompt_of(90, 7)
    req = sched.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=60))
    held = run_tracking_swa(sched)
    assert req.output_ids == hf_generate(hf, prompt, 60)
    assert max(held) <= 10 + RELEASE_STRIDE + CHUNK
    sched.scheduler.check_memory()


def test_swa_flags_reach_the_engine():
    engine, _ = parse_args(["--model-path", "m", "--disable-hybrid-swa-memory", "--swa-full-tokens-ratio", "0.5"])
    assert engine["disable_hybrid_swa_memory"] is True and engine["swa_full_tokens_ratio"] == 0.5
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--swa-full-tokens-ratio", "1.5"])


async def test_engine_with_overlap_matches_transformers_and_replays(default_tokenizer, tmp_path):
    """The async engine (overlap on, flight recorder on) over a SWA pool that must reclaim: every
    request's tokens are transformers', the state reports the pool, and the dump replays exactly."""
    cfg = MistralConfig(
        **(COMMON | dict(vocab_size=len(default_tokenizer), max_position_embeddings=1024)), sliding_window=WINDOW
    )
    hf = save_random_model(cfg, PLAIN_INIT, tmp_path / "model")
    default_tokenizer.save_pretrained(tmp_path / "model")
    opts = dict(dtype="float32", device="cpu", torch_threads=1, max_total_tokens=900, chunked_prefill_size=48)
    prompts = [prompt_of(60 + 37 * i, 30 + i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    async with Engine(
        str(tmp_path / "model"),
        enable_overlap=True,
        swa_full_tokens_ratio=0.4,
        flight_recorder_dir=str(tmp_path),
        **opts,
    ) as engine:
        results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        state = await engine.get_internal_state()
        path = engine.dump_flight_recorder()
    for result, prompt in zip(results, prompts):
        assert result.token_ids == hf_generate(hf, prompt, 60)
    assert state["swa_tokens"] == 360 and state["swa_used_tokens"] is not None
    report = replay(path)
    assert report.divergence is None, report.divergence.describe()


def test_tensor_parallel_ranks_replay_the_swa_table(mistral):
    """TP=2: the worker rank replays rank 0's SWA slots with the table writes; a long prompt and a
    long generation past the window (releases on rank 0) give transformers' tokens."""
    folder, hf = mistral
    args = family_args(folder, tp_size=2, torch_threads=1, chunked_prefill_size=CHUNK, max_total_tokens=800)
    driver = TPDriver(args)
    try:
        runner = driver.load()
        assert isinstance(runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
        sched = SyncScheduler(runner, args)
        prompts = [prompt_of(150, 60), prompt_of(90, 61)]
        reqs = [sched.add_request(p, SamplingParams(temperature=0.0, max_new_tokens=100)) for p in prompts]
        held = run_tracking_swa(sched)
        sched.scheduler.check_memory()
    finally:
        driver.stop(healthy=True)
    assert [r.output_ids for r in reqs] == [hf_generate(hf, p, 100) for p in prompts]
    assert max(held) <= 2 * (WINDOW + RELEASE_STRIDE + CHUNK)
