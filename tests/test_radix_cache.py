"""RadixCache / ChunkCache against the real pools, real `Req`s and real `ScheduleBatch` allocation.

Besides slot accounting, the simulations track what each KV slot "contains" (the token prefix it
was computed for) so that sharing a wrong or recycled slot shows up as wrong content.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.cache.radix_cache import ChunkCache, RadixCache, TreeNode
from engine.sampling import SamplingParams
from engine.scheduler.batch import Req, ScheduleBatch

torch.set_num_threads(1)

CTX = 64


def make(ps: int = 1, kv_tokens: int = 256, rows: int = 8, chunk: bool = False):
    pool = ReqToTokenPool(rows, CTX)
    alloc = TokenToKVPoolAllocator(kv_tokens + ps, page_size=ps)
    cls = ChunkCache if chunk else RadixCache
    return pool, alloc, cls(pool, alloc, page_size=ps)


def new_req(rid: str, ids: list[int]) -> Req:
    return Req(rid, ids, SamplingParams(), seed=0, max_context_len=CTX)


def slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def free_pages(alloc: TokenToKVPoolAllocator) -> list[int]:
    return list(alloc._free_pages)


def tree_values(cache: RadixCache) -> list[int]:
    return cache.all_values().tolist()


def check_idle(cache, pool: ReqToTokenPool, alloc: TokenToKVPoolAllocator) -> None:
    """The scheduler's idle invariant plus: no double frees, tree slots unique and not free."""
    assert cache.protected_size() == 0
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == alloc.size
    assert pool.available_size() == pool.size
    fp = free_pages(alloc)
    assert len(set(fp)) == len(fp), "a page was freed twice"
    assert 0 not in fp
    if isinstance(cache, RadixCache):
        vals = tree_values(cache)
        assert len(vals) == len(set(vals)) == cache.total_size()
        assert 0 not in vals
        assert not {v // alloc.page_size for v in vals} & set(fp)


class Sim:
    """A tiny scheduler: admits, (chunk-)prefills and decodes requests, tracking slot content."""

    def __init__(self, ps: int = 1, kv_tokens: int = 256, rows: int = 8, chunk: bool = False) -> None:
        self.ps = ps
        self.pool, self.alloc, self.cache = make(ps, kv_tokens, rows, chunk)
        self.content: dict[int, tuple[int, ...]] = {}  # slot -> token prefix its KV encodes

    def row(self, req: Req) -> list[int]:
        return self.pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()

    def admit(self, req: Req, chunk_len: int | None = None) -> bool:
        """Match, lock and prefill (the first chunk of) `req`; False (nothing held) on OOM."""
        req.init_next_round_input(self.cache)
        self.check_prefix(req.fill_ids, req.prefix_indices.tolist())
        if chunk_len is not None and req.extend_input_len > chunk_len:  # as PrefillAdder does
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk_len]
            req.extend_input_len = chunk_len
            req.is_chunked = 1
        self.cache.inc_lock_ref(req.last_node)
        if not self.extend(req):
            self.cache.dec_lock_ref(req.last_node)
            return False
        return True

    def continue_chunk(self, req: Req, chunk_len: int | None) -> bool:
        req.init_next_round_input()  # no cache: prefix_indices from cache_unfinished_req stay
        if chunk_len is not None and len(req.fill_ids) > len(req.prefix_indices) + chunk_len:
            req.fill_ids = req.fill_ids[: len(req.prefix_indices) + chunk_len]
            req.extend_input_len = chunk_len
        else:
            req.is_chunked = 0
        return self.extend(req)

    def extend(self, req: Req) -> bool:
        batch = ScheduleBatch.init_new([req], self.pool, self.alloc, self.cache)
        if not batch.prepare_for_extend():
            self.cache.evict(req.extend_input_len + self.ps)
            if not batch.prepare_for_extend():
                return False
        row = self.row(req)
        for i in range(len(req.prefix_indices), req.kv_committed_len):
            self.content[row[i]] = tuple(req.fill_ids[: i + 1])
        return True

    def decode(self, reqs: list[Req]) -> bool:
        # Make room up front instead of relying on prepare_for_decode's rollback.
        need = sum(r.kv_committed_len % self.ps == 0 for r in reqs) * self.ps
        if self.alloc.available_size() < need:
            self.cache.evict(need - self.alloc.available_size())
            if self.alloc.available_size() < need:
                return False
        batch = ScheduleBatch.init_new(reqs, self.pool, self.alloc, self.cache)
        assert batch.prepare_for_decode()
        for req in reqs:
            seq = req.origin_input_ids + req.output_ids
            self.content[self.row(req)[-1]] = tuple(seq[: req.kv_committed_len])
        return True

    def check_prefix(self, ids: list[int], slot_list: list[int]) -> None:
        for i, s in enumerate(slot_list):
            assert self.content[s] == tuple(ids[: i + 1]), f"slot {s} at position {i} holds other KV"

    def check_running(self, req: Req) -> None:
        self.check_prefix(req.origin_input_ids + req.output_ids, self.row(req))

    def check_tree(self) -> None:
        """Every tree slot holds the KV of exactly the path prefix leading to it."""
        cache = self.cache

        def walk(node: TreeNode, prefix: list[int]) -> None:
            for child in node.children.values():
                path = prefix + child.key
                for j, s in enumerate(child.value.tolist()):
                    assert self.content[s] == tuple(path[: len(prefix) + j + 1])
                walk(child, path)

        walk(cache.root, [])

    def check_accounting(self, running: list[Req]) -> None:
        """Mid-run: free pages, tree pages and requests' own pages partition the pool."""
        ps = self.ps
        tree = {v // ps for v in tree_values(self.cache)}
        free = free_pages(self.alloc)
        assert len(set(free)) == len(free)
        assert not tree & set(free)
        own_total: set[int] = set()
        for req in running:
            row = self.row(req)
            n_tree = len(req.prefix_indices) // ps * ps
            assert {s // ps for s in row[:n_tree]} <= tree, "a request's prefix left the tree"
            own = {s // ps for s in row[n_tree:]} - tree
            assert not own & set(free), "a running request's page is on the free list"
            assert not own & own_total, "two requests own the same page"
            own_total |= own
        assert len(free) + len(tree) + len(own_total) == self.alloc.num_pages - 1
        assert self.cache.evictable_size() + self.cache.protected_size() == len(tree) * ps


# ---- insert / match ---------------------------------------------------------------------------


def test_insert_match_and_split():
    _, _, cache = make()
    assert cache.insert([1, 2, 3, 4, 5], slots(11, 12, 13, 14, 15)) == 0
    assert cache.total_size() == cache.evictable_size() == 5

    vals, node = cache.match_prefix([1, 2, 3])
    assert vals.tolist() == [11, 12, 13] and vals.dtype == torch.int64
    assert node.key == [1, 2, 3] and len(node.children) == 1  # split: [1,2,3] -> [4,5]
    assert next(iter(node.children.values())).key == [4, 5]

    vals, node2 = cache.match_prefix([1, 2, 3, 9, 9])
    assert vals.tolist() == [11, 12, 13] and node2 is node

    vals, node3 = cache.match_prefix([7, 1])
    assert vals.numel() == 0 and node3 is cache.root

    assert cache.insert([1, 2, 3, 7, 8], slots(21, 22, 23, 27, 28)) == 3
    assert cache.total_size() == 7  # the duplicate [1,2,3] slots were not taken
    vals, _ = cache.match_prefix([1, 2, 3, 7, 8, 9])
    assert vals.tolist() == [11, 12, 13, 27, 28]
    vals, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert vals.tolist() == [11, 12, 13, 14, 15]
    assert cache.insert([1, 2], slots(31, 32)) == 2
    assert cache.total_size() == 7
    assert "[3] len=1" in cache.pretty_print()  # [1,2,3] split again by the [1,2] insert


def test_insert_split_inside_node_keeps_locks():
    _, _, cache = make()
    cache.insert([1, 2, 3, 4], slots(1, 2, 3, 4))
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.insert([1, 2, 9], slots(5, 6, 7))  # splits the locked node after [1, 2]
    assert cache.protected_size() == 4 and cache.evictable_size() == 1
    assert cache.evict(100) == 1  # only the new [9] leaf can go
    cache.dec_lock_ref(leaf)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(leaf)


def test_finished_requests_share_and_free_duplicates():
    sim = Sim()
    prompt = list(range(100, 110))
    a, b = new_req("a", prompt), new_req("b", prompt)
    assert sim.admit(a) and sim.admit(b)  # both admitted before either is cached: no sharing yet
    assert set(sim.row(a)).isdisjoint(sim.row(b))
    for r in (a, b):
        r.output_ids.append(7)
    assert sim.decode([a, b])  # KV for the token 7; committed = 11
    for r in (a, b):
        r.output_ids.append(8)  # sampled last: never gets KV
    a_slots = sim.row(a)
    sim.cache.cache_finished_req(a)
    assert a.req_pool_idx is None and sim.cache.total_size() == 11
    before = sim.alloc.available_size()
    sim.cache.cache_finished_req(b)
    assert sim.alloc.available_size() == before + 11  # all of b's were duplicates
    assert sim.cache.total_size() == 11
    check_idle(sim.cache, sim.pool, sim.alloc)

    c = new_req("c", prompt + [7, 8, 5])
    assert sim.admit(c)
    assert c.prefix_indices.tolist() == a_slots  # served from the tree, a's slots
    assert sim.cache.protected_size() == 11
    sim.check_running(c)
    c.output_ids.append(1)
    sim.cache.cache_finished_req(c)
    check_idle(sim.cache, sim.pool, sim.alloc)
    assert sim.cache.total_size() == 13


# ---- eviction ---------------------------------------------------------------------------------


def test_lru_eviction_order_and_locks():
    pool, alloc, cache = make()
    for key in ([1, 1, 1], [2, 2, 2, 2], [3, 3]):  # inserted a, b, c in that order
        assert cache.insert(key, alloc.alloc(len(key))) == 0
    cache.match_prefix([1, 1, 1])  # touch a: LRU order is now b, c, a
    assert cache.evict(1) == 4  # the whole b node goes, nothing else
    assert cache.match_prefix([2, 2])[0].numel() == 0
    assert cache.match_prefix([3, 3])[0].numel() == 2 and cache.match_prefix([1])[0].numel() == 1
    # match_prefix above touched c then a, and split a: a=[1] -> [1,1]
    _, node_a = cache.match_prefix([1, 1, 1])
    cache.inc_lock_ref(node_a)
    assert cache.evict(100) == 2  # only c; a is locked
    assert cache.total_size() == cache.protected_size() == 3
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    cache.dec_lock_ref(node_a)
    assert cache.evict(100) == 3
    check_idle(cache, pool, alloc)
    assert alloc.available_size() == alloc.size


def test_evict_parents_become_leaves():
    pool, alloc, cache = make()
    cache.insert([1, 2, 3], alloc.alloc(3))
    dup = alloc.alloc(3)
    assert cache.insert([1, 2, 4], dup) == 2  # tree: [1,2] -> {[3], [4]}
    alloc.free(dup[:2])  # the caller's copies of [1, 2]
    _, leaf4 = cache.match_prefix([1, 2, 4])
    cache.inc_lock_ref(leaf4)
    assert cache.evict(10) == 1  # [3] only: [1,2] still has the locked child
    assert cache.evictable_size() == 0 and cache.protected_size() == 3
    cache.dec_lock_ref(leaf4)
    assert cache.evict(1) == 1  # exactly the [4] leaf; its parent is now a leaf but enough freed
    assert cache.total_size() == 2
    assert cache.evict(1) == 2  # the parent goes whole
    assert cache.total_size() == 0 and cache.root.is_leaf()
    check_idle(cache, pool, alloc)


def test_evict_frees_exactly_the_evicted_slots():
    pool, alloc, cache = make(kv_tokens=16)
    s1, s2 = alloc.alloc(5), alloc.alloc(6)
    cache.insert([1] * 5, s1)
    cache.insert([2] * 6, s2)
    free_before = set(free_pages(alloc))
    assert cache.evict(3) == 5
    assert set(free_pages(alloc)) == free_before | set(s1.tolist())
    cache.reset()
    check_idle(cache, pool, alloc)
    assert alloc.available_size() == alloc.size and cache.total_size() == 0


# ---- pages ------------------------------------------------------------------------------------


def test_page_size_4_aligns_keys_and_frees_tails():
    sim = Sim(ps=4, kv_tokens=64)
    prompt = list(range(1, 11))  # 10 tokens
    a = new_req("a", prompt)
    assert sim.admit(a) and a.kv_committed_len == 10
    a.output_ids.append(99)
    sim.cache.cache_finished_req(a)
    assert sim.cache.total_size() == 8  # 2 whole pages; the 2-token tail page was freed
    assert sim.alloc.available_size() == sim.alloc.size - 8
    check_idle(sim.cache, sim.pool, sim.alloc)

    vals, _ = sim.cache.match_prefix(prompt)
    assert len(vals) == 8
    vals, node = sim.cache.match_prefix(prompt[:6] + [0, 0, 0])  # diverges inside page 2
    assert len(vals) == 4 and node.key == prompt[:4]  # split on the page boundary only

    b = new_req("b", prompt[:9] + [50, 51, 52])
    assert sim.admit(b)
    assert len(b.prefix_indices) == 8
    assert all(s % 4 == i % 4 for i, s in enumerate(sim.row(b)))  # offsets within pages hold
    sim.check_running(b)
    b.output_ids.append(3)
    sim.cache.cache_finished_req(b)
    check_idle(sim.cache, sim.pool, sim.alloc)
    assert sim.cache.total_size() == 12
    assert sim.cache.insert([1, 2, 3], slots(5, 6, 7)) == 0  # shorter than a page: nothing stored
    assert sim.cache.total_size() == 12


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
