"""The scheduler's side of multi-LoRA: which adapters the held requests pin, and unloading.

Decided where the data lives: the `Scheduler` holds every request that holds memory, so it pins
a request's adapter in the LoRA pool when it places the request (`pin`: made resident first,
evicting the least recently used adapter no held request pins) and lets go wherever a request
leaves it (`unpin`, from `Scheduler._release`: finish, abort, retraction, a failed forward).

Admission (the PrefillAdder's planning, waiting_queue.py) keeps every batch's adapters within
`max_loras_per_batch`, the pool's slot count: the budget names the adapters pinned now
(`in_use`), and a waiting request whose adapter is neither among them nor fits in what is left
is skipped this round (SGLang's rule). The adapters of the held requests plus the admitted ones
then never exceed the slots, so `pin` always finds one (it is resident, or an unpinned adapter
can be evicted for it) and every forward's adapters fit the pool.

Unloading an adapter a held request uses is refused (`InvalidRequestError` naming it): its
requests would otherwise run on without it. The Receiver refuses it first when any open request
names the adapter, waiting ones included, and stops accepting the name meanwhile (engine/lora_operations.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.cache.base_prefix_cache import BasePrefixCache
from engine.errors import InvalidRequestError
from engine.lora import BASE_SLOT, LoRAPool, LoRARegistry
from engine.scheduler.req import Req


class LoRAAdmission:
    """Pins and unloading (see the module docstring); a no-op for base-model requests."""

    def __init__(self, pool: LoRAPool | None, registry: LoRARegistry | None, max_loras_per_batch: int) -> None:
        self.pool, self.registry = pool, registry
        self.max_loras = max_loras_per_batch if pool is not None else 0  # 0: LoRA off

    @classmethod
    def of(cls, runner) -> LoRAAdmission:
        """For `runner`'s LoRAManager (off when it has none)."""
        lora = getattr(runner, "lora", None)
        if lora is None:
            return cls(None, None, 0)
        return cls(lora.pool, lora.registry, lora.max_loras_per_batch)

    def in_use(self) -> list[str]:
        """Adapters some held request pins (each needs its slot in every forward it joins)."""
        pool = self.pool
        return [] if pool is None else [name for name in pool.names if pool.pins(name)]

    def pin(self, req: Req) -> None:
        """The scheduler takes `req`: its adapter resident and pinned, its slot on the request."""
        if req.lora_path is None or req.lora_slot != BASE_SLOT:
            return
        assert self.pool is not None and self.registry is not None, "a LoRA request on an engine without LoRA"
        self.pool.load(req.lora_path, self.registry.get(req.lora_path))
        req.lora_slot = self.pool.acquire(req.lora_path)

    def unpin(self, req: Req) -> None:
        """`req` leaves the scheduler (any way): its adapter may be evicted once nobody pins it."""
        if req.lora_slot == BASE_SLOT:
            return
        assert self.pool is not None and req.lora_path is not None
        self.pool.release(req.lora_path)
        req.lora_slot = BASE_SLOT

    def unload(self, name: str, held: Iterable[Req], tree_cache: BasePrefixCache) -> None:
        """Forget adapter `name`: refused while a held request uses it; its cached prefixes are
        freed, its slot cleared (on the device stream, by the runner's next `apply_pending`)."""
        if self.pool is None or self.registry is None:
            raise InvalidRequestError("LoRA is not enabled on this engine (enable_lora)", "lora_name")
        users = sum(1 for r in held if r.lora_path == name)
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {users} request(s)", "lora_name")
        if name not in self.registry:
            raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
        key = self.registry.cache_key(name)
        tree_cache.drop_namespace(key)
        if name in self.pool:
            self.pool.unload(name)
        self.registry.remove(name)
