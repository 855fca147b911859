"""Hybrid sliding-window KV memory (SGLang's SWA pool): local layers keep only what they can read.

A sliding-window layer (Mistral's every layer, Gemma 2/3's local ones) attends the last `window`
positions only; the KV it holds for older positions is dead weight. With hybrid SWA memory each
token gets two slots:

- a **full slot**, the index the request table (`ReqToTokenPool.req_to_token`) and the radix tree
  store, backing the full-attention layers' buffers (none for a model whose every layer is local:
  then full slots are only names, which cost an index and nothing else);
- a **SWA slot** in a smaller pool backing the local layers' buffers, reached through
  `full_to_swa` (0: none, the padding slot).

A running request *releases* its SWA slots as its positions leave the window
(`release_out_of_window`, from `ScheduleBatch` before each forward is planned); its full slots stay.
A released slot is still live, and reclaimable: an allocation that finds the SWA pool short
tombstones released slots, oldest first. A *tombstone* (a full slot without a SWA slot) can still
be read by global layers, never by local ones. Until reclaimed, released KV serves as cache: a later
request continuing the prefix (a shared system prompt, the next turn of a chat) finds it live. The
radix tree keeps tombstoned prefixes (their full KV is intact); a match is cut so that its last
`window` positions are live (`engine/cache/swa_radix_cache.py`), which is all a local layer of the
continuing request reads, and takes those back from the released set.

Safety of a release, the invariant: every running request's last `window` positions before its
`kv_computed_len` are live. A request releases only positions before `kv_computed_len - window`
(a forward still running reads at or after `kv_computed_len - window + 1`: its queries start at the
computed length), and only positions nobody else can be reading: its own tail, or tree nodes on its
path that no other request has locked.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from engine.cache.memory_pool import KVCache, ReqToTokenPool, TokenToKVPoolAllocator

if TYPE_CHECKING:
    from engine.model_config import ModelConfig
    from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

# A request's positions are released in steps of at least this many tokens (never fewer than a
# page): per-step releases of one token would cost a host call per request per decode step.
RELEASE_STRIDE = 32


class SWATokenToKVPoolAllocator:
    """Full slots with a SWA slot each; the `TokenToKVPoolAllocator` interface over both.

    Both pools have the same page size, and a full page's slots map onto one SWA page's slots in
    order, so the tail-of-page arithmetic of `alloc_extend` holds in both spaces. Allocation takes
    both or neither; `free` frees both (every page touched, as the plain allocator does).

    Released slots. A SWA slot its request no longer reads is *released*: still live (a later
    request may continue that prefix, as a shared system prompt or the next turn of a chat), but
    reclaimable: counted as available, and tombstoned, oldest release first, when an allocation
    finds the SWA pool short. A match that will read released slots takes them back (`unrelease`).
    """

    def __init__(
        self, full_size: int, swa_size: int, window: int, page_size: int = 1, device: torch.device | str = "cpu"
    ) -> None:
        self.window = window  # the largest local window: positions older than it are dead to every local layer
        self.full = TokenToKVPoolAllocator(full_size, page_size, device)
        self.swa = TokenToKVPoolAllocator(swa_size, page_size, device)
        self.page_size = page_size
        self.device = torch.device(device)
        # The most one request can hold (admission counts a token as a slot in each pool);
        # `full_size` is the token index space the request table and the tree live in.
        self.size = min(self.full.size, self.swa.size)
        self.full_size = self.full.size
        n = self.full.num_pages * page_size
        self.full_to_swa = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.released = torch.zeros(n, dtype=torch.bool, device=self.device)  # by full slot
        self._release_order: deque[torch.Tensor] = deque()  # may hold stale entries (flag cleared)
        self.num_released = 0

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()
        self.released.zero_()
        self._release_order.clear()
        self.num_released = 0

    def available_size(self) -> int:
        """Tokens a new allocation can take: a slot in each pool (released SWA slots count)."""
        return min(self.full.available_size(), self.swa.available_size() + self.num_released)

    def full_available_size(self) -> int:
        return self.full.available_size()

    def _swa_alloc(self, need: int, swa_last: int = 0, prefix_len: int = 0) -> torch.Tensor | None:
        self._reclaim(-(-need // self.page_size) * self.page_size)
        if prefix_len:
            return self.swa.alloc_extend(swa_last, prefix_len, need)
        return self.swa.alloc(need)

    def alloc(self, need: int) -> torch.Tensor | None:
        full = self.full.alloc(need)
        if full is None:
            return None
        swa = self._swa_alloc(need)
        if swa is None:
            self.full.free(full)
            return None
        self.full_to_swa[full] = swa
        return full

    def alloc_extend(self, last_slot: int, prefix_len: int, need: int) -> torch.Tensor | None:
        full = self.full.alloc_extend(last_slot, prefix_len, need)
        if full is None:
            return None
        # The last position's page is never released (see `release_out_of_window`), so its SWA
        # slot is live and the SWA page's tail continues where the full page's does.
        swa = self._swa_alloc(need, int(self.full_to_swa[last_slot]) if prefix_len else 0, prefix_len)
        if swa is None:
            self.full.free_extend(full, prefix_len)
            return None
        self.full_to_swa[full] = swa
        return full

    # the plain allocator's: it frees through `self.free`, which here frees both slots
    free_extend = TokenToKVPoolAllocator.free_extend

    def _page_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Every slot of the pages `slots` touch (the unit both allocators free)."""
        slots = slots.to(torch.int64)
        if self.page_size == 1:
            return slots
        pages = torch.unique(slots // self.page_size)
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=slots.device)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        pages = self._page_slots(slots)
        self.unrelease(pages)
        self._tombstone(pages)
        self.full.free(slots)

    def _tombstone(self, slots: torch.Tensor) -> None:
        """Free the SWA slots of these full slots (whole pages); the full slots stay allocated."""
        swa = self.full_to_swa[slots]
        live = swa[swa != 0]
        if live.numel():
            self.swa.free(live)
            self.full_to_swa[slots] = 0

    def release(self, slots: torch.Tensor) -> int:
        """These full slots' SWA slots (whole pages) are read by nobody now: reclaimable."""
        slots = slots.to(torch.int64)
        fresh = slots[(self.full_to_swa[slots] != 0) & ~self.released[slots]]
        if fresh.numel():
            self.released[fresh] = True
            self._release_order.append(fresh)
            self.num_released += int(fresh.numel())
        return int(fresh.numel())

    def unrelease(self, slots: torch.Tensor) -> None:
        """A request will read these slots again (a prefix match's window): not reclaimable."""
        if not self.num_released or slots.numel() == 0:
            return
        pages = self._page_slots(slots)
        taken = pages[self.released[pages]]
        if taken.numel():
            self.released[taken] = False
            self.num_released -= int(taken.numel())

    def _reclaim(self, need: int) -> None:
        """Tombstone released slots, oldest first, until the SWA pool has `need` free (or none is left)."""
        while self.swa.available_size() < need and self._release_order:
            chunk = self._release_order.popleft()
            chunk = chunk[self.released[chunk]]  # whole pages, in position order
            short = need - self.swa.available_size()
            if short < chunk.numel():  # the rest stays released, first in line
                self._release_order.appendleft(chunk[short:])
                chunk = chunk[:short]
            if chunk.numel():
                self.released[chunk] = False
                self.num_released -= int(chunk.numel())
                self._tombstone(chunk)

    def live(self, slots: torch.Tensor) -> torch.Tensor:
        """Which of these full slots still have a SWA slot (bool, same shape)."""
        return self.full_to_swa[slots.to(torch.int64)] != 0

    def swa_used(self) -> int:
        """SWA slots in use (live windows, the tree's live parts, released slots)."""
        return self.swa.size - self.swa.available_size()

    def swa_held(self) -> int:
        """SWA slots in use that are not reclaimable."""
        return self.swa_used() - self.num_released

    def idle_error(self, tree_slots: torch.Tensor) -> str | None:
        """When nothing runs: every SWA slot in use belongs to a live slot of the tree."""
        live = int(self.live(tree_slots).sum()) if tree_slots.numel() else 0
        if live != self.swa_used():
            return f"SWA leak: {self.swa_used()} SWA slots in use, {live} live in the tree"
        return None


class WindowedReq(Protocol):
    req_pool_idx: int | None
    kv_computed_len: int
    swa_released_len: int


class PathLocks(Protocol):
    def exclusive_start(self, req: WindowedReq) -> int: ...  # first position only `req` may be reading


def release_out_of_window(
    reqs: list[WindowedReq],
    pool: ReqToTokenPool,
    alloc: SWATokenToKVPoolAllocator,
    cache: PathLocks,
) -> int:
    """Release the SWA slots of the positions each request's window has left; returns how many.

    Releases whole pages, at least `RELEASE_STRIDE` positions at a time, from `swa_released_len`
    (positions below it are released already, or shared with others when this request passed
    them) up to `kv_computed_len - alloc.window` (see the module docstring for why that is safe).
    """
    ps, window = alloc.page_size, alloc.window
    stride = max(RELEASE_STRIDE, ps)
    freed = 0
    for req in reqs:
        row = req.req_pool_idx
        if row is None:
            continue
        end = (req.kv_computed_len - window) // ps * ps
        if end - req.swa_released_len < stride:
            continue
        start = max(req.swa_released_len, cache.exclusive_start(req))
        if start < end:
            freed += alloc.release(pool.req_to_token[row, start:end])
        req.swa_released_len = end
    return freed


def hybrid_pool_sizes(
    max_total_tokens: int | None,
    budget_bytes: int,
    layer_token_bytes: int,
    windows: tuple[int, ...],
    ratio: float,
    page_size: int,
) -> tuple[int, int]:
    """(full, SWA) pool sizes in slots, each with its padding page (SGLang's sizing).

    `max_total_tokens` sizes the full pool and the SWA pool is `ratio` of it; otherwise the bytes
    are split so that full * global layers + SWA * local layers fill `budget_bytes`, SWA = ratio *
    full. A model with no global layer has a full pool of names only (`1 / ratio` of the SWA one).
    """
    num_local = sum(1 for w in windows if w)
    num_global = len(windows) - num_local
    if max_total_tokens is not None:
        full = max_total_tokens
    else:
        full = int(budget_bytes // (layer_token_bytes * (num_global + ratio * num_local)))
    swa = int(full * ratio)
    full, swa = (max(n // page_size * page_size, page_size) + page_size for n in (full, swa))
    return full, swa


def build_hybrid_memory(
    args: ServerArgs,
    cfg: ModelConfig,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    budget_bytes: int,
    req_to_token_pool: ReqToTokenPool,
    agree: Callable[[int], int] = lambda n: n,
) -> tuple[SWATokenToKVPoolAllocator, KVCache]:
    """The allocator and the KV buffers of hybrid SWA memory; the table follows the map.

    `agree` makes a size the same on every tensor-parallel rank (the smallest): slots are
    allocated on rank 0 and name the same slot everywhere; a worker rank's allocator only keeps
    the map its replayed table writes fill (`ReqToTokenPool.apply_writes`)."""
    windows, ps = cfg.layer_windows, args.page_size
    layer_token_bytes = KVCache.bytes_per_token(1, kv_heads, cfg.head_dim, dtype)
    ratio = args.swa_full_tokens_ratio
    full, swa = hybrid_pool_sizes(args.max_total_tokens, budget_bytes, layer_token_bytes, windows, ratio, ps)
    full, swa = agree(full), agree(swa)
    args.check_pool(min(full, swa) - ps, req_to_token_pool.max_context_len - 1)
    alloc = SWATokenToKVPoolAllocator(full, swa, cfg.max_window, ps, device)
    req_to_token_pool.attach_swa(alloc.full_to_swa)
    sizes = tuple(swa if w else full for w in windows)
    kv_cache = KVCache(full, cfg.num_layers, kv_heads, cfg.head_dim, dtype, device, sizes)
    local = sum(1 for w in windows if w)
    log.info(
        "KV pool: hybrid SWA memory: %d full tokens (%d global layers), %d SWA tokens (%d local layers, "
        "window %d) (%.1f MiB)",
        alloc.full.size,
        cfg.num_layers - local,
        alloc.swa.size,
        local,
        cfg.max_window,
        kv_cache.nbytes / 2**20,
    )
    return alloc, kv_cache
