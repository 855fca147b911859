"""Helpers of the prefix-cache tests: real pools, real `Req`s and real `ScheduleBatch` allocation,
and `Sim`, a scheduler-like driver that tracks what each KV slot "contains" (the token prefix it was
computed for) so that sharing a wrong or recycled slot shows up as wrong content."""

from __future__ import annotations

import torch

from engine.cache.chunk_cache import ChunkCache
from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.cache.radix_cache import RadixCache, TreeNode
from engine.sampling import SamplingParams
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req

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
        req.kv_computed_len = req.kv_committed_len  # the "forward" completed (Scheduler.process_batch_result)
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
            req.kv_computed_len = req.kv_committed_len
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
