"""Read a PEFT LoRA adapter folder into per-module (A, B, scaling) triples, checked against the base model.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or the older
`adapter_model.bin`). Each adapted module `m` of layer `i` stores `lora_A` `[r, in]` and `lora_B`
`[out, r]`; its output is `base(x) + scaling * B @ A @ x`, with `scaling = alpha / r`
(`alpha / sqrt(r)` under rsLoRA), `r` and `alpha` possibly overridden per module by
`rank_pattern` / `alpha_pattern` (PEFT's matching: a pattern applies when it matches the module
name's tail at a dot boundary; the first matching pattern wins).

What we serve is exactly that product: anything that changes it (DoRA's magnitudes, LoRA biases,
`bias` other than "none", whole replaced modules `modules_to_save`, trained token rows, adapted
parameters instead of modules) is refused with a `LoRAError` naming the field, never half-applied.
`fan_in_fan_out` only transposes the merged delta of a GPT-2 style `Conv1D` base: A and B are
stored as `nn.Linear` weights either way, so it changes nothing here (shapes are checked anyway).

Phi-3's fused checkpoint modules (`qkv_proj`, `gate_up_proj`) carry one A and a B whose rows are
the parts' (q|k|v, gate|up): each part becomes a module of its own sharing that A, so everything
downstream sees Llama's seven module names only (projections.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.lora.errors import LoRAError
from engine.lora.projections import FUSED_MODULES, FUSED_PARENT, MODULE_PARENT, MODULES, module_shape, projection_of
from engine.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output head

# Config fields whose (truthy) value means the adapter computes more than `scaling * B @ A @ x`
_REFUSED = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "modules_to_save": "adapters with modules_to_save (fully trained modules) are not supported",
    "target_parameters": "adapters on parameters (target_parameters) are not supported",
    "trainable_token_indices": "adapters with trained token rows (trainable_token_indices) are not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
}
# base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>[.<adapter name>].weight
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$"
)
_CHECKPOINT_PARENT = {**MODULE_PARENT, **FUSED_PARENT}


def pattern_key(patterns: Mapping[str, Any], module_key: str) -> str | None:
    """The first key of `patterns` (a `rank_pattern` / `alpha_pattern`) that applies to the module
    named `module_key` (e.g. `model.layers.3.self_attn.q_proj`), as PEFT matches them."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return key
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of `adapter_config.json` that decide what the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: frozenset[str] | str | None = None  # names, one regex, or None (the tensors decide)
    fan_in_fan_out: bool = False

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str = "adapter_config.json") -> AdapterConfig:
        """Check and keep the fields; a `LoRAError` for anything we cannot serve."""
        peft_type = raw.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            raise LoRAError(f"{where}: peft_type {peft_type!r} is not a LoRA adapter", "lora_path")
        for key, message in _REFUSED.items():
            if raw.get(key):
                raise LoRAError(f"{where}: {message}", "lora_path")
        if raw.get("bias", "none") != "none":
            raise LoRAError(f"{where}: bias={raw['bias']!r} is not supported (only 'none')", "lora_path")
        r, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
        if not _is_int(r) or r <= 0 or not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise LoRAError(f"{where}: r={r!r} / lora_alpha={alpha!r} must be a positive int and a number", "lora_path")
        ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
        if not isinstance(ranks, dict) or not all(_is_int(v) and v > 0 for v in ranks.values()):
            raise LoRAError(f"{where}: rank_pattern must map module patterns to positive ints", "lora_path")
        if not isinstance(alphas, dict) or not all(isinstance(v, (int, float)) for v in alphas.values()):
            raise LoRAError(f"{where}: alpha_pattern must map module patterns to numbers", "lora_path")
        return cls(
            r=int(r),
            lora_alpha=float(alpha),
            use_rslora=bool(raw.get("use_rslora", False)),
            rank_pattern={str(k): int(v) for k, v in ranks.items()},
            alpha_pattern={str(k): float(v) for k, v in alphas.items()},
            target_modules=_targets(raw.get("target_modules"), where),
            fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
        )

    def rank_and_alpha(self, module_key: str) -> tuple[int, float]:
        """(r, alpha) of the module named `module_key`, after the per-module patterns."""
        r_key, a_key = pattern_key(self.rank_pattern, module_key), pattern_key(self.alpha_pattern, module_key)
        r = self.rank_pattern[r_key] if r_key is not None else self.r
        return r, self.alpha_pattern[a_key] if a_key is not None else self.lora_alpha

    def scaling(self, module_key: str) -> float:
        r, alpha = self.rank_and_alpha(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, num_layers: int) -> frozenset[str]:
        """The module names (ours and Phi-3's fused ones) the config targets in a model of `num_layers`."""
        names = (*MODULES, *FUSED_MODULES)
        if self.target_modules is None or self.target_modules == ALL_LINEAR:
            return frozenset(names)
        if isinstance(self.target_modules, frozenset):
            return self.target_modules
        pattern = self.target_modules
        keys = {n: [f"model.layers.{i}.{_CHECKPOINT_PARENT[n]}.{n}" for i in range(num_layers)] for n in names}
        return frozenset(n for n in names if any(re.fullmatch(pattern, k) for k in keys[n]))


@dataclass(frozen=True)
class LoRAModule:
    """One adapted module: `delta(x) = scaling * (x @ a.T) @ b.T`."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its modules by (layer, Hugging Face module name), on the host."""

    modules: Mapping[tuple[int, str], LoRAModule]
    config: AdapterConfig
    source: str = ""

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> frozenset[str]:
        """The Hugging Face module names it adapts in at least one layer (Phi-3's fused ones split)."""
        return frozenset(name for _, name in self.modules)

    @property
    def projections(self) -> frozenset[str]:
        """Our projections (projections.PROJECTIONS) it adapts in at least one layer."""
        return frozenset(projection_of(name)[0] for name in self.target_modules)


def load_adapter(path: str | Path, cfg: ModelConfig, dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Read the PEFT adapter folder `path` for a base model of config `cfg` (see the module docstring).
    `dtype`: cast the tensors to it (None keeps the stored dtype; the pool casts to its own)."""
    folder = Path(path).expanduser()
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAError(f"{folder} is not a PEFT adapter folder (no {CONFIG_FILE})", "lora_path")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"cannot read {config_file}: {e}", "lora_path") from e
    if not isinstance(raw, dict):
        raise LoRAError(f"{config_file} does not hold a JSON object", "lora_path")
    config = AdapterConfig.from_dict(raw, str(config_file))
    tensors = _read_tensors(folder)
    return adapter_from_tensors(config, tensors, cfg, dtype, str(folder))


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    file = folder / SAFETENSORS_FILE
    try:
        if file.is_file():
            with safe_open(str(file), framework="pt") as f:
                return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not iterable
        file = folder / BIN_FILE
        if file.is_file():  # weights_only: a pickle from elsewhere must not run code
            state = torch.load(str(file), map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise LoRAError(f"{file} does not hold a dict of tensors", "lora_path")
            return state
    except LoRAError:
        raise
    except Exception as e:  # SafetensorError, pickle / OSError: the file is unusable either way
        raise LoRAError(f"cannot read the adapter weights {file}: {e}", "lora_path") from e
    raise LoRAError(f"{folder} has no {SAFETENSORS_FILE} or {BIN_FILE}", "lora_path")


def adapter_from_tensors(
    config: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dtype: torch.dtype | None = None,
    source: str = "<tensors>",
) -> LoRAAdapter:
    """Map PEFT tensor names to (layer, module) pairs and check every shape against `cfg`."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise LoRAError(f"{source}: unsupported adapter tensor {name}", "lora_path")
        layer, parent, module, kind = int(match[1]), match[2], match[3], match[4]
        if _CHECKPOINT_PARENT.get(module) != parent:
            raise LoRAError(f"{source}: {name} adapts {parent}.{module}, which the model does not have", "lora_path")
        if not 0 <= layer < cfg.num_layers:
            raise LoRAError(f"{source}: {name} names layer {layer}; the model has {cfg.num_layers}", "lora_path")
        slot = pairs.setdefault((layer, module), {})
        if kind in slot:
            raise LoRAError(f"{source}: more than one lora_{kind} for layer {layer} {module}", "lora_path")
        slot[kind] = tensor if dtype is None else tensor.to(dtype)
    targets = config.targets(cfg.num_layers)
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, module), ab in sorted(pairs.items()):
        where = f"{source}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            have, lack = ("A", "B") if "A" in ab else ("B", "A")
            raise LoRAError(f"{where} has lora_{have} but no lora_{lack}", "lora_path")
        if module not in targets:
            raise LoRAError(f"{where} is not in the config's target_modules", "lora_path")
        key = f"model.layers.{layer}.{_CHECKPOINT_PARENT[module]}.{module}"
        for part, a, b in _parts(module, ab["A"], ab["B"], cfg, where):
            expected_r = config.rank_and_alpha(key)[0]
            in_f, out_f = module_shape(cfg, part)
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise LoRAError(
                    f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                    f"[r, {in_f}] / [{out_f}, r] (the base {part} is {in_f} -> {out_f})",
                    "lora_path",
                )
            if a.shape[0] != expected_r:
                raise LoRAError(f"{where}: rank {a.shape[0]}, but the config says r={expected_r}", "lora_path")
            if (layer, part) in modules:
                raise LoRAError(f"{where}: {part} is adapted twice (fused and unfused tensors)", "lora_path")
            modules[(layer, part)] = LoRAModule(a, b, config.scaling(key))
    if not modules:
        raise LoRAError(f"{source}: the adapter holds no LoRA tensors", "lora_path")
    return LoRAAdapter(modules, config, source)


def _parts(
    module: str, a: torch.Tensor, b: torch.Tensor, cfg: ModelConfig, where: str
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(Hugging Face module, A, B) of each part: the module itself, or a fused module's parts
    (one shared A; B's rows cut by the parts' sizes)."""
    if module not in FUSED_MODULES:
        return [(module, a, b)]
    parts = FUSED_MODULES[module]
    sizes = [module_shape(cfg, p)[1] for p in parts]
    if b.dim() != 2 or b.shape[0] != sum(sizes):
        raise LoRAError(f"{where}: lora_B {tuple(b.shape)} should have {sum(sizes)} rows ({sizes})", "lora_path")
    return [(p, a, rows) for p, rows in zip(parts, b.split(sizes, dim=0))]


def _targets(value: Any, where: str) -> frozenset[str] | str | None:
    """`target_modules` as module names (each checked) or as one regex string."""
    if value is None:
        return None
    if isinstance(value, str):
        return ALL_LINEAR if value.lower() == ALL_LINEAR else value
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise LoRAError(f"{where}: target_modules must be a list of names or a regex string", "lora_path")
    names = {v.rpartition(".")[2] for v in value}  # PEFT matches a listed name against the key's tail
    unknown = sorted(names - set(_CHECKPOINT_PARENT))
    if unknown:
        supported = ", ".join(_CHECKPOINT_PARENT)
        raise LoRAError(f"{where}: target_modules {unknown} are not supported (supported: {supported})", "lora_path")
    return frozenset(names)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
