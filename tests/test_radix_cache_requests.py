"""Prefix caches and requests: chunked prefill, unfinished requests re-pointed at the tree,
ChunkCache, and randomized scheduler simulations that track what every KV slot contains."""

from __future__ import annotations

import random

import pytest
import torch

from engine.scheduler.req import Req
from tests.radix_sim import CTX, Sim, check_idle, new_req


@pytest.mark.parametrize("ps", [1, 4])
def test_chunked_prefill_then_decode_then_finish(ps):
    sim = Sim(ps=ps, kv_tokens=128)
    cache = sim.cache
    prompt = [random.Random(1).randrange(1000) for _ in range(17)]
    req = new_req("r", prompt)
    assert sim.admit(req, chunk_len=5)
    assert req.kv_committed_len == 5 and req.is_chunked
    cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == 5
    assert cache.total_size() == 5 // ps * ps
    assert cache.protected_size() == cache.total_size()  # the lock moved onto the new node
    assert req.prefix_indices.tolist() == sim.row(req)
    sim.check_running(req)
    sim.check_accounting([req])

    # Another request sharing the prompt sees the chunk already cached, at the same slots.
    other = new_req("o", prompt[:9] + [1, 2])
    other.init_next_round_input(cache)
    assert other.prefix_indices.tolist() == sim.row(req)[: 5 // ps * ps]

    while req.is_chunked:
        assert sim.continue_chunk(req, chunk_len=5)
        if req.is_chunked:
            cache.cache_unfinished_req(req)
            assert cache.total_size() == req.kv_committed_len // ps * ps
        sim.check_running(req)
        sim.check_accounting([req])
    assert req.kv_committed_len == 17
    for tok in (500, 501, 502):
        req.output_ids.append(tok)
        assert sim.decode([req])
        sim.check_running(req)
    cache.cache_unfinished_req(req)  # a running request can share its prefix too
    assert cache.total_size() == 20 // ps * ps
    sim.check_accounting([req])
    req.output_ids.append(503)
    assert sim.decode([req])
    sim.check_running(req)
    req.output_ids.append(504)  # final sampled token, no KV
    cache.cache_finished_req(req)
    assert cache.total_size() == 21 // ps * ps and req.kv_committed_len == 21
    check_idle(cache, sim.pool, sim.alloc)
    sim.check_tree()
    vals, _ = cache.match_prefix(prompt + [500, 501, 502, 503, 504])
    assert len(vals) == 21 // ps * ps


@pytest.mark.parametrize("ps", [1, 4])
def test_unfinished_duplicates_are_freed_and_row_repointed(ps):
    sim = Sim(ps=ps, kv_tokens=128)
    prompt = list(range(200, 213))  # 13 tokens
    a, b = new_req("a", prompt), new_req("b", prompt)
    assert sim.admit(a, chunk_len=10) and sim.admit(b, chunk_len=10)
    sim.cache.cache_unfinished_req(a)
    free_before = sim.alloc.available_size()
    b_own = sim.row(b)
    sim.cache.cache_unfinished_req(b)
    aligned = 10 // ps * ps
    assert sim.alloc.available_size() == free_before + aligned  # b's duplicate pages went back
    assert sim.row(b)[:aligned] == sim.row(a)[:aligned]  # b now reads the tree's slots
    assert sim.row(b)[aligned:] == b_own[aligned:]  # and keeps its own unaligned tail
    assert b.last_node is a.last_node
    assert b.last_node.lock_ref == 2
    sim.check_accounting([a, b])
    for r in (a, b):
        assert sim.continue_chunk(r, chunk_len=None)
        sim.check_running(r)
        r.output_ids.append(1)
    sim.check_accounting([a, b])
    for r in (a, b):
        sim.cache.cache_finished_req(r)
    check_idle(sim.cache, sim.pool, sim.alloc)
    sim.check_tree()
    assert sim.cache.total_size() == 13 // ps * ps


# ---- ChunkCache -------------------------------------------------------------------------------


@pytest.mark.parametrize("ps", [1, 4])
def test_chunk_cache(ps):
    sim = Sim(ps=ps, kv_tokens=64, chunk=True)
    cache = sim.cache
    prompt = list(range(1, 12))
    req = new_req("r", prompt)
    assert sim.admit(req, chunk_len=6)
    assert req.last_node is None
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == sim.row(req) and len(req.prefix_indices) == 6
    assert sim.continue_chunk(req, chunk_len=None)
    assert req.kv_committed_len == 11
    sim.check_running(req)
    assert cache.insert(prompt, torch.tensor(sim.row(req))) == 0
    assert cache.evictable_size() == cache.protected_size() == cache.evict(100) == 0
    twin = new_req("t", prompt)
    twin.init_next_round_input(cache)
    assert twin.prefix_indices.numel() == 0  # nothing is shared without the radix tree
    req.output_ids.append(5)
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None
    assert sim.alloc.available_size() == sim.alloc.size
    check_idle(cache, sim.pool, sim.alloc)


# ---- randomized -------------------------------------------------------------------------------


@pytest.mark.parametrize("ps,seed", [(1, 0), (1, 1), (4, 2), (4, 3), (2, 4)])
def test_randomized_scheduler_simulation(ps, seed):
    rng = random.Random(seed)
    sim = Sim(ps=ps, kv_tokens=160, rows=6)
    cache = sim.cache
    bases = [[rng.randrange(6) for _ in range(rng.randrange(0, 24))] for _ in range(4)]
    running: list[Req] = []
    chunked: Req | None = None
    stats = {"hit": 0, "admitted": 0, "evicted": 0, "oom": 0}
    n = 0

    def finish(req: Req) -> None:
        req.output_ids.append(rng.randrange(6))  # the last sampled token
        cache.cache_finished_req(req)

    for _ in range(300):
        op = rng.random()
        if op < 0.3 and chunked is None:
            base = rng.choice(bases)
            suffix = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            prompt = base[: rng.randrange(len(base) + 1)] + suffix
            n += 1
            req = new_req(f"r{n}", prompt)
            chunk_len = rng.choice([None, 4, 7])
            if sim.admit(req, chunk_len):
                stats["admitted"] += 1
                stats["hit"] += len(req.prefix_indices)
                if req.is_chunked:
                    cache.cache_unfinished_req(req)
                    chunked = req
                else:
                    req.output_ids.append(rng.randrange(6))
                    running.append(req)
            else:
                stats["oom"] += 1
        elif op < 0.45 and chunked is not None:
            req = chunked
            if sim.continue_chunk(req, rng.choice([None, 5])):
                if req.is_chunked:
                    cache.cache_unfinished_req(req)
                else:
                    chunked = None
                    req.output_ids.append(rng.randrange(6))
                    running.append(req)
            elif rng.random() < 0.5:  # give up on it (abort) rather than wait
                cache.cache_finished_req(req)
                chunked = None
        elif op < 0.75 and running:
            if not sim.decode(running):
                victim = running.pop(rng.randrange(len(running)))  # retract
                cache.cache_finished_req(victim)
                continue
            for req in list(running):
                req.output_ids.append(rng.randrange(6))
                if req.seqlen >= CTX - 2 or rng.random() < 0.15:
                    running.remove(req)
                    finish(req)
        elif op < 0.85 and running:
            cache.cache_unfinished_req(rng.choice(running))
        elif op < 0.92:
            stats["evicted"] += cache.evict(rng.randrange(1, 40))
        else:
            for req in running:
                sim.check_running(req)
            sim.check_accounting(running + ([chunked] if chunked else []))
            sim.check_tree()

    live = running + ([chunked] if chunked else [])
    for req in live:
        sim.check_running(req)
    sim.check_accounting(live)
    for req in live:
        finish(req)
    check_idle(cache, sim.pool, sim.alloc)
    sim.check_tree()
    assert stats["admitted"] > 20 and stats["hit"] > 0 and stats["evicted"] > 0  # it exercised them
    cache.evict(10**9)
    assert cache.total_size() == 0 and sim.alloc.available_size() == sim.alloc.size
    check_idle(cache, sim.pool, sim.alloc)
