"""What the scheduler hands to the device and gets back: `LaunchedBatch` (a batch in flight,
with what result processing must know about it) and the memory check's error."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.model_executor.forward_batch_info import ForwardMode
from engine.scheduler.batch import ScheduleBatch
from engine.scheduler.req import Req


class MemoryLeakError(RuntimeError):
    """`check_memory` found KV slots or request rows unaccounted for while idle."""


@dataclass
class LaunchedBatch:
    """A batch handed to the device, with what result processing must know about it."""

    batch: ScheduleBatch
    reqs: list[Req]
    epochs: list[int]
    kv_lens: list[int]  # each request's committed KV length with this forward: computed once it completes
    mode: ForwardMode
    mid_chunk: list[bool]  # this forward computed a non-final chunk of that request's prompt
    num_extend: int  # leading rows that prefill (all for EXTEND, none for DECODE; MIXED: the rest decode)
    drafts: list[list[int]] = field(default_factory=list)  # TARGET_VERIFY: each request's drafts
    sync: bool = False  # speculative decoding: the next round's drafts need this one's tokens
    launched_at: float = field(default_factory=time.perf_counter)

    @property
    def needs_sync(self) -> bool:
        """Some request in it needs this batch's token on the host before its next batch is
        built (`Req.needs_sync`): process this result before planning the next batch."""
        return self.sync or any(r.needs_sync() for r in self.reqs)
