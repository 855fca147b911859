"""What replay puts where the model runner was: the parts of a `ModelRunner` the scheduler reads,
rebuilt from a dump's header with no model, no weights and no device (engine/recorder/replay.py).

- Memory of the recorded shape (the request table and the KV slot allocator) and the model's
  facts the scheduler checks (vocabulary, EOS ids, context length).
- Multi-LoRA bookkeeping (`ReplayLoRA`), when the engine served adapters: the scheduler pins
  adapters in pool slots (LRU eviction among unpinned ones, engine/scheduler/lora_admission.py)
  and drops an unloaded adapter's cached prefixes, and those decisions shape every later batch.
  The stand-in pool keeps the same slots and pins without buffers; the stand-in registry knows
  adapters by name only (their folders need not exist where the dump is replayed) and learns each
  one's radix cache key from the recorded requests that named it.
"""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

from engine.cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from engine.cache.swa_pool import SWATokenToKVPoolAllocator
from engine.lora import LoRAError, LoRAPool, parse_lora_paths
from engine.recorder.events import Header
from engine.server_args import ServerArgs

UNSEEN_KEY = -1  # the cache key of an adapter no recorded request named: no cached prefix has it


class SlotBookkeeping(LoRAPool):
    """A `LoRAPool`'s slots, pins and LRU order without its buffers (writes and clears do nothing)."""

    def __init__(self, num_slots: int) -> None:  # no super().__init__: it would allocate the buffers
        self.num_slots = num_slots
        self.max_lora_rank = 0
        self.target_modules = frozenset()
        self.buffers = {}
        self._slots = OrderedDict()
        self._adapters = {}
        self._pins = {}
        self._free = list(range(num_slots - 1, -1, -1))

    def _write(self, slot: int, adapter: object, name: str = "") -> None:
        pass

    def _clear(self, slot: int) -> None:
        pass


class AdapterName(SimpleNamespace):
    """An adapter known by name only: it fits any pool (`LoRAPool.check`)."""

    max_rank = 0
    target_modules = frozenset()


class RecordedRegistry:
    """The `LoRARegistry` calls the scheduler makes, over names (see the module docstring)."""

    def __init__(self, names: list[str]) -> None:
        self._adapters: dict[str, AdapterName] = {name: AdapterName(name=name) for name in names}
        self._keys: dict[str, int] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def add(self, name: str) -> None:
        """A run-time load (a recorded `LoRAAdapterReq`); a name already known stays as it is."""
        self._adapters.setdefault(name, AdapterName(name=name))

    def learn(self, name: str, key: int) -> None:
        """A recorded request ran on `name` under radix cache key `key`."""
        self.add(name)
        self._keys[name] = key

    def get(self, name: str) -> AdapterName:
        if name not in self._adapters:
            raise LoRAError(f"unknown LoRA adapter {name!r}", "lora_path")
        return self._adapters[name]

    def cache_key(self, name: str | None) -> int:
        if name is None:
            return 0
        self.get(name)
        return self._keys.get(name, UNSEEN_KEY)

    def remove(self, name: str) -> None:
        self.get(name)
        del self._adapters[name]
        self._keys.pop(name, None)


class ReplayLoRA:
    """The stand-in runner's `lora` (what `LoRAAdmission.of` reads)."""

    def __init__(self, args: ServerArgs) -> None:
        self.max_loras_per_batch = args.max_loras_per_batch
        self.pool = SlotBookkeeping(args.max_loras_per_batch)
        self.registry = RecordedRegistry(list(parse_lora_paths(args.lora_paths or ())))


def stand_in_runner(header: Header, args: ServerArgs) -> SimpleNamespace:
    """What `Scheduler` reads of a ModelRunner (see the module docstring)."""
    cfg = SimpleNamespace(vocab_size=header.vocab_size, eos_token_ids=frozenset(header.eos_token_ids))
    pool = ReqToTokenPool(header.req_pool_rows, header.req_pool_width)
    alloc: TokenToKVPoolAllocator | SWATokenToKVPoolAllocator
    if header.swa_pool_slots:  # hybrid SWA memory: its releases and reclaims decide admissions
        slots = (header.kv_pool_slots, header.swa_pool_slots)
        alloc = SWATokenToKVPoolAllocator(*slots, header.swa_window, header.page_size)
        pool.attach_swa(alloc.full_to_swa)
    else:
        alloc = TokenToKVPoolAllocator(header.kv_pool_slots, header.page_size)
    return SimpleNamespace(
        args=args,
        model_config=cfg,
        context_len=header.context_len,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=alloc,
        lora=ReplayLoRA(args) if args.enable_lora or args.lora_paths else None,
    )
