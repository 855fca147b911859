"""`LoRARegistry`: the adapters the engine knows by name, read once and kept on the host.

Two tiers, as SGLang has them: up to `max_loaded_loras` adapters held here (what `--lora-paths`
and run-time loading add), and up to `max_loras_per_batch` of them resident on the device at a
time (pool.py), swapped in from here as requests name them. A request names an adapter by the
name it was registered under; an unknown name is a `LoRAError` on `lora_path`.

Each registration gets a fresh `cache_key`: the radix cache keys prefixes by it, not by name, so
an adapter removed and another registered under the same name never share cached KV.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import torch

from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.errors import LoRAError
from engine.model_config import ModelConfig


def parse_lora_paths(specs: Iterable[str]) -> dict[str, str]:
    """`--lora-paths` values, `name=path` or a bare `path` (then named by its path), by name."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = (name.strip(), path.strip()) if sep else (spec.strip(), spec.strip())
        if not name or not path:
            raise LoRAError(f"bad --lora-paths entry {spec!r} (name=path or path)", "lora_paths")
        if name in out:
            raise LoRAError(f"LoRA adapter name {name!r} is given twice", "lora_paths")
        out[name] = path
    return out


class LoRARegistry:
    """Host copies of the registered adapters, by name (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, max_loaded_loras: int | None = None, dtype: torch.dtype | None = None):
        if max_loaded_loras is not None and max_loaded_loras < 1:
            raise LoRAError(f"max_loaded_loras must be at least 1, got {max_loaded_loras}", "max_loaded_loras")
        self.cfg = cfg
        self.max_loaded_loras = max_loaded_loras
        self.dtype = dtype
        self._adapters: dict[str, LoRAAdapter] = {}
        self._keys: dict[str, int] = {}
        self._next_key = itertools.count(1)  # 0 is left for the base model

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._adapters)

    def add(self, name: str, adapter: LoRAAdapter | str | Path) -> LoRAAdapter:
        """Register `adapter` (or the PEFT folder at that path) as `name`."""
        if name in self._adapters:
            raise LoRAError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
        if self.max_loaded_loras is not None and len(self._adapters) >= self.max_loaded_loras:
            raise LoRAError(f"max_loaded_loras ({self.max_loaded_loras}) adapters are already loaded", "lora_name")
        if not isinstance(adapter, LoRAAdapter):
            adapter = load_adapter(adapter, self.cfg, self.dtype)
        self._adapters[name] = adapter
        self._keys[name] = next(self._next_key)
        return adapter

    def remove(self, name: str) -> None:
        """Forget `name` (the caller unloads it from the pool first: `LoRAPool.unload`)."""
        self.get(name)
        del self._adapters[name], self._keys[name]

    def get(self, name: str) -> LoRAAdapter:
        if name not in self._adapters:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise LoRAError(f"unknown LoRA adapter {name!r} (loaded: {known})", "lora_path")
        return self._adapters[name]

    def cache_key(self, name: str | None) -> int:
        """The radix cache's key for requests on `name` (0: the base model)."""
        if name is None:
            return 0
        self.get(name)
        return self._keys[name]
