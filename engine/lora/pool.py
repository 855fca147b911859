"""`LoRAPool`: the adapters resident on the model's device, in stacked per-slot buffers.

One forward may mix the base model and up to `max_loras_per_batch` adapters, so every adapter a
forward uses must sit in a slot of buffers that one kernel indexes by slot. Per (layer, projection):

- `a`: `[slots, parts * R, in]` — slot s's A of part p (q/k/v, gate/up, or the only part) in
  rank rows `[p*R, p*R + r)`, zeros below `R = max_lora_rank`: one shape serves every rank, and a
  fused projection's shrink is one matmul over the stacked A's;
- `b`: `[slots, out, R]` — the rows of part p multiply rank block p only, so B needs no
  zero blocks (a `[out, parts * R]` block-diagonal form would triple q|k|v's expand);
- `scaling`: `[slots, parts * R]` float32, per rank column (0 in the padding): the parts of a
  fused projection may have different scalings (`rank_pattern` / `alpha_pattern`), and applying
  it to the shrink's output keeps it out of the weights;
- `bt` (the torch path): `[slots, parts * R, out]`, B transposed and block-diagonal, so a
  segment's expand is one matmul added into the output in place. On a CPU a LoRA forward's cost
  is the number of small ops (about 40% of a decode step with one op per part), not the zero
  blocks' flops;
- `a_packed` / `bt_packed` (the C++ path, csrc/cpu_lora.cpp): the same A and block-diagonal Bt
  in groups of G values of the summed dimension that fill 32 bits (G = 2 in bf16, 1 in fp32),
  `[slots, ceil(in / G), ranks, G]` and `[slots, ranks / G, out, G]` with `ranks` = parts * R
  rounded up to 16 (zeros in the padding), so one vector load holds G summed-over values for a
  vector of outputs (`pack` writes them from `a` and `b` when a slot is loaded).

A part the adapter does not adapt holds zeros (its delta is 0); `active` lists, per buffer, the
slots holding something, so the torch path can skip the rest.

Slots are recycled least-recently-used first, among adapters no running request holds: a request
pins its adapter (`acquire`) while it runs and lets go (`release`) when it ends. With every slot
pinned a new adapter cannot come in (`LoRAPoolFullError`: transient, the request should wait).
`BASE_SLOT` (-1) means "no adapter": such rows are never touched.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from engine.distributed.sharding import TPShard
from engine.kernels import cpu_extension
from engine.lora.adapter import LoRAAdapter
from engine.lora.errors import LoRAError, LoRAPoolFullError
from engine.lora.projections import FUSED_MODULES, MODULES, PROJECTIONS, projection_of, projection_sizes, shard_lora
from engine.model_config import ModelConfig

BASE_SLOT = -1  # a request without an adapter


@dataclass
class LoRAWeights:
    """The stacked buffers of one (layer, projection) (see the module docstring)."""

    a: torch.Tensor  # [slots, parts * max_rank, in]
    b: torch.Tensor  # [slots, out, max_rank]
    scaling: torch.Tensor  # [slots, parts * max_rank] float32
    out_sizes: tuple[int, ...]  # this rank's output columns of each part
    max_rank: int
    part_table: torch.Tensor  # [2, parts] int32 on the device: out_starts, out_sizes (the kernels')
    active: set[int] = field(default_factory=set)  # slots that adapt this projection in this layer
    bt: torch.Tensor | None = None  # [slots, parts * max_rank, out]: the torch path's expand
    a_packed: torch.Tensor | None = None  # [slots, ceil(in / G), ranks, G]: the C++ path's shrink
    bt_packed: torch.Tensor | None = None  # [slots, ranks / G, out, G]: the C++ path's expand

    @property
    def out_starts(self) -> tuple[int, ...]:
        return tuple(sum(self.out_sizes[:p]) for p in range(len(self.out_sizes)))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for packed in (self.bt, self.a_packed, self.bt_packed):
            if packed is not None:
                packed[slot].zero_()
        self.scaling[slot].zero_()
        self.active.discard(slot)

    def pack(self, slot: int) -> None:
        """Write slot's `a_packed` / `bt_packed` from its `a` and `b` (the C++ path's layout)."""
        if self.a_packed is None or self.bt_packed is None:
            return
        groups, ranks, g = self.a_packed.shape[1:]
        used, in_f = self.a.shape[1], self.a.shape[2]
        a = self.a.new_zeros(ranks, g * groups)
        a[:used, :in_f] = self.a[slot]
        self.a_packed[slot] = a.view(ranks, groups, g).transpose(0, 1)
        bt = self.a.new_zeros(ranks, self.bt_packed.shape[2])
        r = self.max_rank
        for p, (first, n) in enumerate(zip(self.out_starts, self.out_sizes)):
            bt[p * r : (p + 1) * r, first : first + n] = self.b[slot, first : first + n].T
        self.bt_packed[slot] = bt.view(ranks // g, g, -1).transpose(1, 2)


KERNELS = ("torch", "cpu", "triton")
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # what csrc/cpu_lora.cpp computes in


def default_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The SGMV Triton kernels on a GPU; on a CPU in bf16 and fp32 the C++ loops (csrc/cpu_lora.cpp;
    in bf16 the fused layer loop runs the same ones, so a forward's output does not depend on which
    path took it); torch ops elsewhere (fp16, or a CPU without the built extension)."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and cpu_extension.load() is not None:
        return "cpu"
    return "torch"


def resolve_target_modules(names: Iterable[str] | None) -> frozenset[str]:
    """`--lora-target-modules` as Hugging Face module names: None or "all" = every one; Phi-3's
    fused names stand for their parts. Anything else is a `LoRAError`."""
    if names is None:
        return frozenset(MODULES)
    out: set[str] = set()
    for name in names:
        if name in ("all", "all-linear"):
            out |= set(MODULES)
        elif name in FUSED_MODULES:
            out |= set(FUSED_MODULES[name])
        elif name in MODULES:
            out.add(name)
        else:
            supported = ", ".join((*MODULES, *FUSED_MODULES, "all"))
            raise LoRAError(f"unknown LoRA target module {name!r} (supported: {supported})", "lora_target_modules")
    return frozenset(out)


def _packed_buffers(slots: int, in_f: int, used: int, out: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The C++ path's zeroed `a_packed` and `bt_packed` (module docstring)."""
    ranks, g = -(-used // 16) * 16, 4 // dtype.itemsize
    return {
        "a_packed": torch.zeros(slots, -(-in_f // g), ranks, g, dtype=dtype),
        "bt_packed": torch.zeros(slots, ranks // g, out, g, dtype=dtype),
    }


class LoRAPool:
    """`max_loras_per_batch` slots of adapter weights on `device` (this TP rank's shard of them)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        max_loras_per_batch: int = 8,
        max_lora_rank: int = 16,
        target_modules: Iterable[str] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        shard: TPShard | None = None,
        kernel: str | None = None,
    ) -> None:
        if max_loras_per_batch < 1:
            raise LoRAError(f"max_loras_per_batch must be at least 1, got {max_loras_per_batch}", "max_loras_per_batch")
        if max_lora_rank < 1:
            raise LoRAError(f"max_lora_rank must be at least 1, got {max_lora_rank}", "max_lora_rank")
        self.cfg = cfg
        self.shard = shard if shard is not None else TPShard.of(cfg)
        self.num_slots = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.target_modules = resolve_target_modules(target_modules)
        self.device, self.dtype = torch.device(device), dtype
        # How ops.apply_lora computes (chosen here, never inside a forward; "triton" on CPU needs
        # TRITON_INTERPRET=1: tests)
        self.kernel = kernel if kernel is not None else default_kernel(self.device, dtype)
        if self.kernel not in KERNELS:
            raise ValueError(f"unknown LoRA kernel {self.kernel!r} ({', '.join(KERNELS)})")
        if self.kernel == "cpu" and dtype not in CPU_KERNEL_DTYPES:
            raise ValueError(f"the C++ LoRA kernel computes in bf16 or fp32, not {dtype}")
        self.projections = tuple(p for p, parts in PROJECTIONS.items() if self.target_modules & set(parts))
        self.buffers: dict[tuple[int, str], LoRAWeights] = {}
        r, s = max_lora_rank, max_loras_per_batch
        for layer in range(cfg.num_layers):
            for projection in self.projections:
                in_f, sizes = projection_sizes(cfg, self.shard, projection)
                n = len(sizes)
                self.buffers[(layer, projection)] = LoRAWeights(
                    a=torch.zeros(s, n * r, in_f, device=self.device, dtype=dtype),
                    b=torch.zeros(s, sum(sizes), r, device=self.device, dtype=dtype),
                    scaling=torch.zeros(s, n * r, device=self.device, dtype=torch.float32),
                    out_sizes=sizes,
                    max_rank=r,
                    part_table=torch.tensor([[sum(sizes[:p]) for p in range(n)], sizes], dtype=torch.int32).to(
                        self.device
                    ),
                    bt=torch.zeros(s, n * r, sum(sizes), device=self.device, dtype=dtype)
                    if self.kernel == "torch"
                    else None,
                    **(_packed_buffers(s, in_f, n * r, sum(sizes), dtype) if self.kernel == "cpu" else {}),
                )
        self._slots: OrderedDict[str, int] = OrderedDict()  # resident name -> slot, least recent first
        self._adapters: dict[str, LoRAAdapter] = {}
        self._pins: dict[str, int] = {}
        self._free = list(range(s - 1, -1, -1))  # popped from the end: slot 0 first

    # ---- queries ---------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    @property
    def names(self) -> tuple[str, ...]:
        """Resident adapters, least recently used first."""
        return tuple(self._slots)

    def slot_of(self, name: str) -> int:
        if name not in self._slots:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded", "lora_path")
        return self._slots[name]

    def pins(self, name: str) -> int:
        """How many running requests hold `name` (0 for one not resident)."""
        return self._pins.get(name, 0)

    def weights(self, layer: int, projection: str) -> LoRAWeights | None:
        """The buffers of `projection` in `layer`; None where no target module falls in it."""
        return self.buffers.get((layer, projection))

    def slot_active(self, slot: int) -> bool:
        return slot in self._slots.values()

    # ---- load / unload -------------------------------------------------------------------------

    def check(self, adapter: LoRAAdapter, name: str = "") -> None:
        """Raise `LoRAError` unless `adapter` fits this pool (its rank, its target modules)."""
        label = f"LoRA adapter {name!r}" if name else "LoRA adapter"
        if adapter.max_rank > self.max_lora_rank:
            raise LoRAError(
                f"{label} has rank {adapter.max_rank}, above max_lora_rank={self.max_lora_rank}", "max_lora_rank"
            )
        extra = sorted(adapter.target_modules - self.target_modules)
        if extra:
            raise LoRAError(
                f"{label} adapts {extra}, outside lora_target_modules {sorted(self.target_modules)}",
                "lora_target_modules",
            )

    def load(self, name: str, adapter: LoRAAdapter) -> int:
        """Make `adapter` resident as `name`; returns its slot. An unpinned adapter may be evicted
        to make room (least recently used first); none can be: `LoRAPoolFullError`. Loading a name
        already resident with the same adapter only marks it used; with another, a `LoRAError`."""
        if name in self._slots:
            if self._adapters[name] is not adapter:
                raise LoRAError(f"a different LoRA adapter is already loaded as {name!r}; unload it first", "lora_name")
            self._slots.move_to_end(name)
            return self._slots[name]
        self.check(adapter, name)
        slot = self._free.pop() if self._free else self._evict()
        try:
            self._write(slot, adapter, name)
        except BaseException:
            self._clear(slot)
            self._free.append(slot)
            raise
        self._slots[name] = slot
        self._adapters[name] = adapter
        return slot

    def unload(self, name: str) -> None:
        """Drop `name` from its slot; refused while a running request holds it."""
        slot = self.slot_of(name)
        if self._pins.get(name, 0):
            raise LoRAError(f"LoRA adapter {name!r} is in use by {self._pins[name]} running request(s)", "lora_name")
        self._drop(name)
        self._clear(slot)
        self._free.append(slot)

    def acquire(self, name: str) -> int:
        """Pin `name` for a running request (it cannot be evicted or unloaded); returns its slot."""
        slot = self.slot_of(name)
        self._pins[name] = self._pins.get(name, 0) + 1
        self._slots.move_to_end(name)
        return slot

    def release(self, name: str) -> None:
        """Undo one `acquire` (the request finished or was retracted)."""
        if self._pins.get(name, 0) <= 0:
            raise LoRAError(f"LoRA adapter {name!r} is not held by any request", "lora_name")
        self._pins[name] -= 1
        if not self._pins[name]:
            del self._pins[name]

    def _evict(self) -> int:
        for victim in self._slots:  # least recently used first
            if not self._pins.get(victim, 0):
                slot = self._slots[victim]
                self._drop(victim)
                self._clear(slot)
                return slot
        raise LoRAPoolFullError(
            f"all {self.num_slots} LoRA slots hold adapters in use by running requests (max_loras_per_batch)",
            "max_loras_per_batch",
        )

    def _drop(self, name: str) -> None:
        del self._slots[name]
        del self._adapters[name]
        self._pins.pop(name, None)

    def _clear(self, slot: int) -> None:
        for weights in self.buffers.values():
            weights.clear(slot)

    def _write(self, slot: int, adapter: LoRAAdapter, name: str = "") -> None:
        """Copy this rank's shard of every module of `adapter` (registered as `name`) into `slot`
        (the slot is all zeros)."""
        r = self.max_lora_rank
        written: set[tuple[int, str]] = set()
        for (layer, module), m in adapter.modules.items():
            projection, part = projection_of(module)
            w = self.buffers[(layer, projection)]
            a, b = shard_lora(m.a, m.b, layer, module, self.shard)
            first, rows = w.out_starts[part], w.out_sizes[part]
            if a.shape[1] != w.a.shape[2] or b.shape[0] != rows:  # the adapter was checked for another model
                raise LoRAError(
                    f"LoRA layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit this model",
                    "lora_path",
                )
            w.a[slot, part * r : part * r + m.rank].copy_(a)
            w.b[slot, first : first + rows, : m.rank].copy_(b)
            if w.bt is not None:
                w.bt[slot, part * r : part * r + m.rank, first : first + rows].copy_(b.T)
            w.scaling[slot, part * r : part * r + m.rank] = m.scaling
            w.active.add(slot)
            written.add((layer, projection))
        for key in written:
            self.buffers[key].pack(slot)
