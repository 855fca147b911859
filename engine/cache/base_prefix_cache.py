"""What the scheduler needs from a prefix cache (`BasePrefixCache`), and what a cache needs of a
request (`CacheableReq`): declared here, below the scheduler, so no cache imports scheduler types.
Implementations: `RadixCache` (radix_cache.py) and `ChunkCache` (chunk_cache.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import msgspec
import torch

# Where a prefix match ends: a radix-tree node (radix_cache.TreeNode), None without a tree. Opaque
# here: callers only hand it back to the same cache (lock, unlock).
PrefixNode = Any


class PrefixSummary(msgspec.Struct, frozen=True):
    """One cached prefix, as an operator sees it (the dashboard's radix summary)."""

    head: list[int]  # its first token ids (a short head, not the whole prefix)
    tokens: int  # its length from the root
    subtree_tokens: int  # tokens cached in it and below it
    hits: int  # admitted requests that reused it
    locked: bool  # a running request reads it


class CacheableReq(Protocol):
    """What a prefix cache reads and updates of a request (the scheduler's `Req` has all of it).

    Declared here, below the scheduler, so the cache never imports scheduler types.
    """

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    prefix_indices: torch.Tensor  # int64 KV slots of the cached prefix (+ its own tail)
    req_pool_idx: int | None  # its row in the ReqToTokenPool
    kv_committed_len: int  # positions with KV slots (some may belong to a forward still running)
    kv_computed_len: int  # positions whose KV a forward that completed has written
    last_node: Any  # the tree node its prefix ends at (locked while it runs)
    lora_key: int  # its prefix cache namespace: the LoRA adapter's cache key (0: the base model)


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def committed_tokens(req: CacheableReq) -> list[int]:
    """The token ids of `req`'s first `kv_committed_len` positions, as far as they are known.

    `fill_ids` is exact for a chunk in flight (it is the truncated prompt) but goes stale during
    decode; `origin_input_ids + output_ids` is current but may lag one token under overlap. Both
    are prefixes of the same sequence, so the longer one is the best knowledge.
    """
    committed = req.kv_committed_len
    a = req.fill_ids[:committed]
    b = (req.origin_input_ids + req.output_ids)[:committed]
    return a if len(a) >= len(b) else b


class BasePrefixCache(ABC):
    """What the scheduler needs from a prefix cache, radix or not."""

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: int = 0) -> tuple[torch.Tensor, PrefixNode]:
        """Longest cached prefix of `key` in `namespace` (a LoRA adapter's cache key; 0: the base
        model): (its int64 KV slots, the node it ends at)."""

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: int = 0) -> int:
        """Cache `key -> value`; return how many leading tokens were already cached."""

    def drop_namespace(self, namespace: int) -> int:
        """Free every prefix cached in `namespace` (an unloaded adapter's); the tokens freed."""
        return 0

    @abstractmethod
    def cache_finished_req(self, req: CacheableReq) -> None:
        """Hand a finished request's KV to the cache (or free it) and release its row and lock."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Make a running request's committed KV its prefix for the next round; it keeps its row."""

    def exclusive_start(self, req: CacheableReq) -> int:
        """The first position of `req`'s row that no other request reads (no tree: all its own)."""
        return 0

    def idle_error(self) -> str | None:
        """A broken invariant of this cache's memory when no request holds any (None: intact)."""
        return None

    def evict(self, num_tokens: int) -> int:
        """Free up to (at least, page granularity permitting) `num_tokens` cached slots."""
        return 0

    def inc_lock_ref(self, node: PrefixNode) -> None:
        """Protect `node` and its ancestors from eviction."""

    def dec_lock_ref(self, node: PrefixNode) -> None:
        """Undo one `inc_lock_ref(node)`."""

    def record_hit(self, node: PrefixNode) -> None:
        """An admitted request reuses the prefix ending at `node` (hit counts for summaries)."""

    def top_prefixes(self, k: int = 10) -> list[PrefixSummary]:
        """The most reused and the largest cached prefixes (none without a tree)."""
        return []

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def reset(self) -> None:
        """Drop everything cached (only when no request holds a lock)."""

    def pretty_print(self) -> str:
        return f"<{type(self).__name__}>"
