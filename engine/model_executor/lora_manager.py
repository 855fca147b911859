"""`LoRAManager`: the runner's multi-LoRA state (engine/lora/): the registry of adapters on the host
and the pool of resident ones in this model's device, dtype and shard.

Who touches what. The scheduler decides which adapter a slot holds (`LoRAPool.load` / `acquire` /
`release` / `unload`: LRU eviction among adapters no held request pins) on its own thread, when
it admits or ends requests. The slot's buffers, though, are read by forwards on the device
stream, and a forward launched earlier may still be running (or not started yet) when the
scheduler plans the next one: an evicted adapter may be in it, for a request that finished but
whose dropped token is still being computed (the overlap contract). So `StreamOrderedPool` only
records each slot write or clear, and the device stream applies them in stream order, at the
start of the next forward (or of a control call): a forward never sees a half-written slot, and a
write lands after every forward launched before the decision that caused it.

Loading an adapter folder (disk reads, checks) runs on the device stream too (`load_adapter`),
off the event loop; unloading is the scheduler's decision (engine/scheduler/lora_admission.py)
followed by `apply_pending` on the stream.

Under tensor parallelism every rank holds its shard of the same slots (engine/lora/projections.py)
and the same registry; only rank 0 has a scheduler. So rank 0's runner sends every rank-changing
call to the others first (ModelRunner `load_lora_adapter`, `apply_lora_changes`): a load reads the
folder on each rank (the adapter's path must exist on every host), and `apply_pending` returns
what it did by adapter name (`LoRAChanges`), which the others replay before the same forward.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from engine.distributed.sharding import TPShard
from engine.errors import InvalidServerArgsError
from engine.lora import (
    BASE_SLOT,
    LoRAAdapter,
    LoRABatchInfo,
    LoRAError,
    LoRAPool,
    LoRARegistry,
    load_adapter,
    parse_lora_paths,
)
from engine.model_config import ModelConfig
from engine.model_executor.forward_batch_info import ModelWorkerBatch
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

DEFAULT_MAX_LORA_RANK = 16  # without --max-lora-rank and without adapters at start-up (SGLang's)


@dataclass
class LoRAChanges:
    """What one `apply_pending` did, by adapter name: the other tensor-parallel ranks replay it
    (`LoRAManager.apply_changes`) on their own shards and registries."""

    slots: list[tuple[int, str | None]] = field(default_factory=list)  # in order: written (name) or cleared (None)
    forgotten: list[str] = field(default_factory=list)  # names the registry dropped (unloaded)

    def __bool__(self) -> bool:
        return bool(self.slots or self.forgotten)


class StreamOrderedPool(LoRAPool):
    """A `LoRAPool` whose bookkeeping runs on the scheduler's thread and whose buffer writes run
    on the device stream (`apply_pending`; see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        self._pending: list[tuple[int, str, LoRAAdapter | None]] = []  # (slot, name, adapter or None: clear)
        self._lock = threading.Lock()
        self._on_device: set[int] = set()  # slots whose adapter the buffers hold now
        super().__init__(*args, **kwargs)

    def _write(self, slot: int, adapter: LoRAAdapter, name: str = "") -> None:
        with self._lock:
            self._pending.append((slot, name, adapter))

    def _clear(self, slot: int) -> None:
        with self._lock:
            self._pending.append((slot, "", None))

    def slot_active(self, slot: int) -> bool:
        return slot in self._on_device  # read by LoRABatchInfo.build, on the device stream

    def apply_pending(self) -> list[tuple[int, str | None]]:
        """On the device stream: the slot writes and clears decided so far, in order; what was
        done, by name (`LoRAChanges.slots`)."""
        with self._lock:
            ops, self._pending = self._pending, []
        for slot, _, adapter in ops:
            self.apply_slot(slot, adapter)
        return [(slot, name if adapter is not None else None) for slot, name, adapter in ops]

    def apply_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """On the device stream: clear `slot`, then write `adapter` (None: leave it empty)."""
        LoRAPool._clear(self, slot)
        self._on_device.discard(slot)
        if adapter is not None:
            LoRAPool._write(self, slot, adapter)
            self._on_device.add(slot)


class RecordingRegistry(LoRARegistry):
    """A registry that remembers the names it drops (on the scheduler's thread) until the device
    stream collects them for the other tensor-parallel ranks (`take_removed`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._removed: list[str] = []
        self._lock = threading.Lock()

    def remove(self, name: str) -> None:
        super().remove(name)
        with self._lock:
            self._removed.append(name)

    def take_removed(self) -> list[str]:
        with self._lock:
            removed, self._removed = self._removed, []
        return removed


class LoRAManager:
    """The registry and the pool of one runner (see the module docstring)."""

    def __init__(
        self, args: ServerArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, shard: TPShard
    ) -> None:
        self.max_loras_per_batch = args.max_loras_per_batch
        self.registry = RecordingRegistry(cfg, args.max_loaded_loras, dtype)
        paths = parse_lora_paths(args.lora_paths or ())
        initial = {name: load_adapter(path, cfg, dtype) for name, path in paths.items()}
        rank = args.max_lora_rank
        if rank is None:
            rank = max((a.max_rank for a in initial.values()), default=DEFAULT_MAX_LORA_RANK)
        targets = args.lora_target_modules
        if targets is None and initial:  # SGLang's: the modules the start-up adapters adapt
            targets = sorted(set().union(*(a.target_modules for a in initial.values())))
        self.pool = StreamOrderedPool(
            cfg,
            max_loras_per_batch=args.max_loras_per_batch,
            max_lora_rank=rank,
            target_modules=targets,
            device=device,
            dtype=dtype,
            shard=shard,
        )
        for name, adapter in initial.items():
            self.pool.check(adapter, name)
            self.registry.add(name, adapter)
        log.info(
            "LoRA: %d adapter(s) loaded (%s), %d slots, max rank %d, targets %s",
            len(initial),
            ", ".join(initial) or "none",
            self.pool.num_slots,
            rank,
            ",".join(sorted(self.pool.target_modules)),
        )

    @staticmethod
    def check_model(args: ServerArgs, cfg: ModelConfig) -> None:
        """Refuse LoRA on a model it cannot adapt, before anything is loaded: the adapters' deltas are
        added to the dense projections only, and a mixture-of-experts MLP (Qwen3-MoE, Mixtral) has
        per-expert ones that no pool buffer covers (an adapter of them would be silently dropped)."""
        if args.enable_lora and cfg.moe_layers:
            raise InvalidServerArgsError(
                f"enable_lora: LoRA adapters on mixture-of-experts models ({cfg.architecture}) are not supported yet",
                "enable_lora",
            )

    @classmethod
    def build(cls, args: ServerArgs, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, shard: TPShard):
        """The manager, or None when LoRA is off."""
        return cls(args, cfg, device, dtype, shard) if args.enable_lora else None

    def adapters(self) -> dict[str, int]:
        """The registered adapters by name, with their radix cache keys."""
        return {name: self.registry.cache_key(name) for name in self.registry.names}

    def batch_info(self, batch: ModelWorkerBatch) -> LoRABatchInfo | None:
        """On the device stream, after `apply_pending`: the batch's LoRA view (None when no
        request uses an adapter: the forward runs as without LoRA)."""
        slots = batch.lora_slots
        if slots is None or all(s == BASE_SLOT for s in slots):
            return None
        return LoRABatchInfo.build(self.pool, slots, batch.lora_rows(), self.max_loras_per_batch)

    def load_adapter(self, name: str, path: str) -> int:
        """On the device stream: read and check the adapter at `path`, register it as `name`;
        returns its radix cache key. Nothing changes if it fails (a `LoRAError`)."""
        if name in self.registry:  # before reading anything
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        adapter = load_adapter(path, self.registry.cfg, self.registry.dtype)
        self.pool.check(adapter, name)
        self.registry.add(name, adapter)
        log.info("LoRA adapter %r loaded from %s (rank %d)", name, path, adapter.max_rank)
        return self.registry.cache_key(name)

    def apply_pending(self) -> LoRAChanges:
        """On the device stream: the slot writes and clears decided since the last call; what was
        done, for the other tensor-parallel ranks."""
        return LoRAChanges(self.pool.apply_pending(), self.registry.take_removed())

    def apply_changes(self, slots: list[tuple[int, str | None]], forgotten: list[str]) -> None:
        """A tensor-parallel rank other than 0: replay rank 0's `LoRAChanges` on this rank's
        shard (the adapters were registered here as there: `load_adapter` runs on every rank)."""
        for slot, name in slots:
            self.pool.apply_slot(slot, None if name is None else self.registry.get(name))
        for name in forgotten:
            LoRARegistry.remove(self.registry, name)
