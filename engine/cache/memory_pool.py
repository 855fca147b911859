"""KV memory: the two-level mapping request -> token positions -> KV slots.

`ReqToTokenPool` holds one row per running request mapping each token position to a KV slot;
`TokenToKVPoolAllocator` hands out KV slots (optionally whole pages); `KVCache` owns the per-layer
K/V buffers those slots index. Slot 0 is reserved as padding so a zeroed index table is always
safe to gather from.

Allocation never half-succeeds: an allocator either returns all it was asked for or `None`, and
leaves its state untouched in the latter case. Callers decide what to do (evict, retract, wait).
"""

from __future__ import annotations

from collections import deque

import torch

from engine.host_memory import zeros_on_huge_pages

# One write to the request table: (row, first position, KV slots, their SWA slots: empty without
# hybrid SWA memory), as a worker replays it.
TableWrite = tuple[int, int, list[int], list[int]]


class ReqToTokenPool:
    """`[size, max_context_len]` int32 table; one row (a "req_pool_idx") per running request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free: list[int] = list(range(size))
        # Tensor parallelism: every write, in order, until the next forward ships them to the other
        # ranks' copies of the table (`take_writes` / `apply_writes`). None: not recorded.
        self._journal: deque[TableWrite] | None = None
        # Hybrid SWA memory (engine/cache/swa_pool.py): the same table in SWA slots, kept in step
        # with every write through the allocator's full -> SWA map. None: off.
        self.full_to_swa: torch.Tensor | None = None
        self.req_to_swa_token: torch.Tensor | None = None

    def attach_swa(self, full_to_swa: torch.Tensor) -> None:
        self.full_to_swa = full_to_swa
        self.req_to_swa_token = torch.zeros_like(self.req_to_token)

    def record_writes(self) -> None:
        """Keep every write from now on for `take_writes` (rank 0 of a tensor-parallel group)."""
        self._journal = deque()

    def take_writes(self) -> list[TableWrite]:
        """The writes since the last call, oldest first. Safe against a concurrent `write` from the
        scheduler's thread: each entry is taken once (deque.popleft), a later one waits for the
        next call."""
        journal, out = self._journal, []
        while journal:
            out.append(journal.popleft())
        return out

    def apply_writes(self, writes: list[TableWrite]) -> None:
        """Replay rank 0's writes into this copy of the table (the other ranks). With hybrid SWA
        memory the SWA table too, and the map for the written slots: a forward's own slots are
        among them, which is all a worker's map is read for (`swa_view`)."""
        for idx, start, slots, swa in writes:
            self.req_to_token[idx, start : start + len(slots)] = torch.tensor(slots, dtype=torch.int32)
            if swa and self.full_to_swa is not None and self.req_to_swa_token is not None:
                self.req_to_swa_token[idx, start : start + len(swa)] = torch.tensor(swa, dtype=torch.int32)
                self.full_to_swa[torch.tensor(slots, dtype=torch.int64)] = torch.tensor(swa, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, need: int) -> list[int] | None:
        """Rows for `need` requests, or None (nothing taken) if fewer are free."""
        if need > len(self._free):
            return None
        taken, self._free = self._free[:need], self._free[need:]
        return taken

    def free(self, idx: int | list[int]) -> None:
        self._free.extend([idx] if isinstance(idx, int) else idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """Record that positions [start, start+len(slots)) of request row `idx` live in `slots`."""
        self.req_to_token[idx, start : start + len(slots)] = slots.to(torch.int32)
        swa = None
        if self.full_to_swa is not None:
            swa = self.full_to_swa[slots.to(torch.int64)]
            self.req_to_swa_token[idx, start : start + len(slots)] = swa.to(torch.int32)
        if self._journal is not None:
            self._journal.append((idx, start, slots.tolist(), [] if swa is None else swa.tolist()))

    def write_each(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """One slot per request: position `positions[i]` of row `rows[i]` lives in `slots[i]` (decode)."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)
        swa: list[int] | None = None
        if self.full_to_swa is not None:
            mapped = self.full_to_swa[slots.to(torch.int64)]
            self.req_to_swa_token[rows, positions] = mapped.to(torch.int32)
            swa = mapped.tolist()
        if self._journal is not None:
            for i, (idx, pos, slot) in enumerate(zip(rows, positions, slots.tolist())):
                self._journal.append((idx, pos, [slot], [] if swa is None else [swa[i]]))

    def clear(self) -> None:
        self._free = list(range(self.size))


class TokenToKVPoolAllocator:
    """Free-list allocator of KV slots; with `page_size > 1` it hands out whole pages.

    Slot 0 (page 0 when paged) is never handed out: it is the padding target.
    `alloc(n)` with pages returns `ceil(n / page_size) * page_size` consecutive-per-page slots
    trimmed to `n`; callers that extend a partially filled last page use `alloc_extend`.
    """

    def __init__(self, size: int, page_size: int = 1, device: torch.device | str = "cpu") -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size  # page 0 is the padding page
        self.size = (self.num_pages - 1) * page_size  # usable slots
        self.full_size = self.size  # of the token index space (hybrid SWA memory: the full pool's)
        if self.size <= 0:
            raise ValueError(f"KV pool of {size} tokens is too small for page_size {page_size}")
        self.clear()

    def clear(self) -> None:
        # Free pages as a stack (next page at the end): taking or returning n pages costs O(n),
        # never O(pool), which a slice of the list's head would (and did: decode slowed with size).
        self._free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def full_available_size(self) -> int:
        """Free slots of the token index space (hybrid SWA memory has a second pool beside it)."""
        return self.available_size()

    def alloc(self, need: int) -> torch.Tensor | None:
        """`need` fresh slots (whole new pages), or None if they do not fit."""
        if need < 0:
            raise ValueError(f"cannot allocate {need} slots")
        n_pages = -(-need // self.page_size)
        if n_pages > len(self._free_pages):
            return None
        if n_pages == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        pages = self._free_pages[-n_pages:][::-1]
        del self._free_pages[-n_pages:]
        if self.page_size == 1:
            return torch.tensor(pages, dtype=torch.int64, device=self.device)
        base = torch.tensor(pages, dtype=torch.int64, device=self.device) * self.page_size
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (base[:, None] + offsets[None, :]).reshape(-1)[:need]

    def alloc_extend(self, last_slot: int, prefix_len: int, need: int) -> torch.Tensor | None:
        """Slots for `need` tokens appended after position `prefix_len - 1` stored at `last_slot`.

        With pages, the tail of the current page is used first, then fresh pages. `last_slot` is
        ignored when `prefix_len` is 0 or the page is full.
        """
        if self.page_size == 1 or prefix_len % self.page_size == 0 or need == 0:
            return self.alloc(need) if need else torch.empty(0, dtype=torch.int64, device=self.device)
        used_in_page = prefix_len % self.page_size
        room = self.page_size - used_in_page
        tail = torch.arange(last_slot + 1, last_slot + 1 + min(room, need), dtype=torch.int64, device=self.device)
        if need <= room:
            return tail
        fresh = self.alloc(need - room)
        if fresh is None:
            return None
        return torch.cat([tail, fresh])

    def free_extend(self, slots: torch.Tensor, prefix_len: int) -> None:
        """Undo an `alloc_extend(_, prefix_len, _)`: free only the pages it took fresh.

        The leading slots that filled the tail of the request's current page belong to a page the
        request still uses; freeing them would free that whole page under a live request.
        """
        skip = (-prefix_len) % self.page_size
        if len(slots) > skip:
            self.free(slots[skip:])

    def free(self, slots: torch.Tensor) -> None:
        """Return slots. With pages, every page touched by `slots` is freed.

        Callers free whole requests (every slot they own) or whole fresh allocations, so a page
        is never freed while someone else still holds part of it.
        """
        if slots.numel() == 0:
            return
        if self.page_size == 1:
            self._free_pages.extend(slots.tolist())
            return
        pages = torch.unique(slots // self.page_size)
        self._free_pages.extend(pages.tolist())


class KVCache:
    """Per-layer K and V buffers, `[num_slots, num_kv_heads, head_dim]` each (MHATokenToKVPool)."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_sizes: tuple[int, ...] | None = None,
    ) -> None:
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.shape = (size, num_kv_heads, head_dim)
        # Hybrid SWA memory: the local layers' buffers have the SWA pool's size (swa_pool.py).
        self.layer_sizes = layer_sizes if layer_sizes is not None else (size,) * num_layers
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        self.restore()

    def release(self) -> None:
        """Free every buffer (release_memory_occupation): the memory goes back to the OS or the
        device; what the slots held is gone, so the caller drops every cached prefix."""
        self.k_buffer, self.v_buffer = [], []

    def restore(self) -> None:
        """Zeroed buffers again (at construction, and on resume after `release`)."""
        shapes = [(n, *self.shape[1:]) for n in self.layer_sizes]
        self.k_buffer = [self._zeros(shape) for shape in shapes]
        self.v_buffer = [self._zeros(shape) for shape in shapes]

    @property
    def released(self) -> bool:
        return not self.k_buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.k_buffer, *self.v_buffer))

    def _zeros(self, shape: tuple[int, int, int]) -> torch.Tensor:
        # A CPU decode reads scattered slots: huge pages spare it a TLB miss per row (host_memory).
        if self.device.type == "cpu":
            return zeros_on_huge_pages(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][slots] = k.to(self.dtype)
        self.v_buffer[layer_id][slots] = v.to(self.dtype)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def kv_pool_size_from_budget(
    max_total_tokens: int | None,
    mem_fraction: float | None,
    bytes_per_token: int,
    page_size: int,
    free_bytes: int,
) -> int:
    """Pool size in slots (including the padding page) from a token budget or a memory fraction."""
    if max_total_tokens is not None:
        tokens = max_total_tokens
    else:
        frac = 0.2 if mem_fraction is None else mem_fraction
        tokens = int(free_bytes * frac) // bytes_per_token
    tokens = max(tokens // page_size * page_size, page_size)
    return tokens + page_size  # + the padding page
