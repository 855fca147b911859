"""`LoRABatchInfo`: which rows of one forward use which adapter, grouped so each adapter is one segment.

A forward's rows are its requests' rows in batch order, each request's contiguous (its prefill
chunk, or its one decode row; a mixed batch puts the chunks first, then the decodes). Requests
with the same adapter need not be adjacent, so the rows using an adapter are gathered into one
segment per adapter (a stable sort by slot: within a segment the rows keep their order). Base rows
(`BASE_SLOT`) are in no segment and are never read or written by the LoRA ops.

Built once per forward on the host (O(requests), vectorised over rows) and shared by every layer
and projection; the few index tensors move to the device in one place, as ForwardBatch does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.lora.errors import LoRAError
from engine.lora.pool import BASE_SLOT, LoRAPool


@dataclass(frozen=True)
class LoRABatchInfo:
    """The LoRA view of one forward (see the module docstring)."""

    pool: LoRAPool
    num_rows: int  # every row of the forward, base rows included
    # The forward's rows that use an adapter, segment after segment ([n] int64 on the device);
    # None when that is every row in order (one adapter, or already grouped): no gather needed.
    row_index: torch.Tensor | None
    num_lora_rows: int
    seg_slots: tuple[int, ...]  # host: each segment's slot
    seg_starts: tuple[int, ...]  # host: where each segment starts among the LoRA rows
    seg_lens: tuple[int, ...]
    seg_table: torch.Tensor  # [3, segments] int32 on the device: slots, starts, lengths (the kernels')

    @functools.cached_property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The segments padded to the longest, for the torch path's batched matmuls (built once
        per forward, on first use): (slots `[S]`, the forward's row of each padded position
        `[S * L]` (a pad repeats its segment's first row), the padded position of each LoRA row in
        segment order `[n]`, L)."""
        length = self.max_seg_len
        starts = torch.tensor(self.seg_starts, dtype=torch.int64)
        lens = torch.tensor(self.seg_lens, dtype=torch.int64)
        offsets = torch.arange(length, dtype=torch.int64)
        positions = starts[:, None] + torch.where(offsets[None, :] < lens[:, None], offsets[None, :], 0)
        segment = torch.repeat_interleave(torch.arange(len(self.seg_lens)), lens)
        valid = segment * length + (torch.arange(self.num_lora_rows) - starts[segment])
        device = self.pool.device
        positions = positions.reshape(-1).to(device)
        rows = positions if self.row_index is None else self.row_index[positions]
        slots = torch.tensor(self.seg_slots, dtype=torch.int64, device=device)
        return slots, rows, valid.to(device), length

    @functools.cached_property
    def row_slots(self) -> torch.Tensor:
        """Each row's slot, `BASE_SLOT` for base rows (`[num_rows]` int64 on the device): the fused
        C++ layer loop's per-token view (csrc/cpu_lora.cpp)."""
        device = self.pool.device
        slots = torch.full((self.num_rows,), BASE_SLOT, dtype=torch.int64, device=device)
        lens = torch.tensor(self.seg_lens, dtype=torch.int64)
        per_lora_row = torch.repeat_interleave(torch.tensor(self.seg_slots, dtype=torch.int64), lens).to(device)
        if self.row_index is None:
            slots[: self.num_lora_rows] = per_lora_row
        else:
            slots[self.row_index] = per_lora_row
        return slots

    @property
    def max_seg_len(self) -> int:
        return max(self.seg_lens, default=0)

    @property
    def empty(self) -> bool:
        """No row uses an adapter: the LoRA ops do nothing."""
        return not self.seg_slots

    @classmethod
    def build(
        cls,
        pool: LoRAPool,
        slots: Sequence[int],
        rows: Sequence[int],
        max_loras_per_batch: int | None = None,
    ) -> LoRABatchInfo:
        """From each request's slot (`BASE_SLOT` for none; `LoRAPool.acquire` gave the others) and
        row count, in batch order. More distinct adapters than `max_loras_per_batch` (default: the
        pool's slot count) or a slot holding no adapter is a `LoRAError`: the scheduler must
        not form such a batch."""
        if len(slots) != len(rows):
            raise ValueError(f"{len(slots)} slots for {len(rows)} requests")
        limit = pool.num_slots if max_loras_per_batch is None else max_loras_per_batch
        slot_t = torch.tensor(list(slots), dtype=torch.int64)
        rows_t = torch.tensor(list(rows), dtype=torch.int64)
        if bool((rows_t < 0).any()):
            raise ValueError(f"negative row counts: {list(rows)}")
        used = sorted(set(slot_t[(slot_t != BASE_SLOT) & (rows_t > 0)].tolist()))
        bad = [s for s in used if not (0 <= s < pool.num_slots and pool.slot_active(s))]
        if bad:
            raise LoRAError(f"LoRA slots {bad} hold no adapter", "lora_path")
        if len(used) > limit:
            raise LoRAError(f"{len(used)} LoRA adapters in one batch; max_loras_per_batch is {limit}", "lora_path")
        row_slot = torch.repeat_interleave(slot_t, rows_t)
        num_rows = row_slot.numel()
        lora_rows = (row_slot != BASE_SLOT).nonzero().squeeze(1)
        order = lora_rows[torch.argsort(row_slot[lora_rows], stable=True)]
        seg_slots, seg_lens = torch.unique_consecutive(row_slot[order], return_counts=True)
        seg_starts = torch.cumsum(seg_lens, 0) - seg_lens
        identity = order.numel() == num_rows and bool((order == torch.arange(num_rows)).all())
        device = pool.device
        table = torch.stack([seg_slots, seg_starts, seg_lens]).to(torch.int32)
        return cls(
            pool=pool,
            num_rows=num_rows,
            row_index=None if identity else order.to(device),
            num_lora_rows=order.numel(),
            seg_slots=tuple(seg_slots.tolist()),
            seg_starts=tuple(seg_starts.tolist()),
            seg_lens=tuple(seg_lens.tolist()),
            seg_table=table.to(device),
        )
