"""The radix cache over hybrid SWA memory, and the choice of prefix cache for a scheduler.

`SWARadixCache` is `RadixCache` whose slots may be tombstones (a full slot whose SWA slot was
released: engine/cache/swa_pool.py). The tree keeps them: their full KV serves the global layers,
and a local layer of a request continuing a prefix reads only that prefix's last `window`
positions. So a match is cut back to the longest page-aligned prefix whose last `window` positions
are live (taken back from the released set: engine/cache/swa_pool.py); everything before them
may be tombstones. (SGLang keeps a tombstone flag per node and a
second LRU for SWA slots; here liveness is read from the allocator's map, and eviction frees both
slots of a leaf, as the plain tree does.)
"""

from __future__ import annotations

import torch

from engine.cache.base_prefix_cache import BasePrefixCache, CacheableReq, committed_tokens
from engine.cache.chunk_cache import ChunkCache
from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.cache.radix_cache import RadixCache, TreeNode
from engine.cache.swa_pool import SWATokenToKVPoolAllocator


def live_prefix_len(live: torch.Tensor, window: int, page_size: int) -> int:
    """The longest page-aligned `m <= len(live)` whose positions `[m - window, m)` are all live."""
    m = len(live) // page_size * page_size
    while m > 0:
        lo = max(0, m - window)
        dead = (~live[lo:m]).nonzero()
        if not len(dead):
            return m
        m = (lo + int(dead[-1])) // page_size * page_size  # end before the last dead position
    return 0


class SWARadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWATokenToKVPoolAllocator, page_size: int = 1):
        super().__init__(req_to_token_pool, allocator, page_size)  # type: ignore[arg-type]
        self.swa = allocator

    def match_prefix(self, key: list[int], namespace: int = 0) -> tuple[torch.Tensor, TreeNode]:
        slots, node = super().match_prefix(key, namespace)
        m = live_prefix_len(self.swa.live(slots), self.swa.window, self.page_size)
        if m < len(slots):
            slots, node = super().match_prefix(key[:m], namespace)  # splits the node at m
        self.swa.unrelease(slots[max(0, m - self.swa.window) :])  # the continuing request reads these
        return slots, node

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """As `RadixCache`'s, unless the tree already holds part of this request's prompt (another
        request inserted it first) with tombstones where this request's window still reads: then
        the request keeps its own slots until it finishes."""
        row = req.req_pool_idx
        if row is not None:
            token_ids = committed_tokens(req)
            tree_len = self._tree_len(req)
            n = self._insertable(req, token_ids, tree_len)
            held, _ = self._walk(token_ids[:n], req.lora_key)
            needed_from = max(tree_len, req.kv_computed_len - self.swa.window)
            if len(held) > needed_from and not bool(self.swa.live(held[needed_from:]).all()):
                kv = self.req_to_token_pool.req_to_token[row, : req.kv_committed_len]
                req.prefix_indices = kv.to(torch.int64, copy=True)
                return
        super().cache_unfinished_req(req)
        # the tree's copy of the positions its window still reads may have been released
        self.swa.unrelease(req.prefix_indices[max(0, req.kv_computed_len - self.swa.window) :])

    def idle_error(self) -> str | None:
        """When nothing runs: every SWA slot in use is a live slot of the tree."""
        return self.swa.idle_error(self.all_values())


def make_prefix_cache(
    req_to_token_pool: ReqToTokenPool,
    allocator: TokenToKVPoolAllocator | SWATokenToKVPoolAllocator,
    page_size: int,
    disable_radix_cache: bool,
) -> BasePrefixCache:
    """ChunkCache without the radix cache; the SWA tree over hybrid SWA memory; else RadixCache."""
    if disable_radix_cache:
        return ChunkCache(req_to_token_pool, allocator, page_size)  # type: ignore[arg-type]
    if isinstance(allocator, SWATokenToKVPoolAllocator):
        return SWARadixCache(req_to_token_pool, allocator, page_size)
    return RadixCache(req_to_token_pool, allocator, page_size)
