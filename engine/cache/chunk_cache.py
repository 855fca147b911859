"""`ChunkCache`: the prefix cache when prefix sharing is disabled."""

from __future__ import annotations

import torch

from engine.cache.base_prefix_cache import BasePrefixCache, CacheableReq, empty_slots
from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator


class ChunkCache(BasePrefixCache):
    """No prefix sharing: each request only ever reuses its own KV (across prefill chunks)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int = 1,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    def match_prefix(self, key: list[int], namespace: int = 0) -> tuple[torch.Tensor, None]:
        return empty_slots(), None

    def insert(self, key: list[int], value: torch.Tensor, namespace: int = 0) -> int:
        return 0

    def cache_finished_req(self, req: CacheableReq) -> None:
        row = req.req_pool_idx
        if row is None:
            raise ValueError(f"cache_finished_req: {req!r} holds no req_to_token row")
        kv = self.req_to_token_pool.req_to_token[row, : req.kv_committed_len].to(torch.int64)
        self.token_to_kv_pool_allocator.free(kv)
        self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        row = req.req_pool_idx
        if row is None:
            raise ValueError(f"cache_unfinished_req: {req!r} holds no req_to_token row")
        kv = self.req_to_token_pool.req_to_token[row, : req.kv_committed_len]
        req.prefix_indices = kv.to(torch.int64, copy=True)
