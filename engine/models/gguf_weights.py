"""GGUF weights: a fast index of the file, and its tensors under Hugging Face parameter names.

Why not `gguf.GGUFReader`: it builds a numpy view for every element of every metadata array, and a
GGUF carries its whole tokenizer vocabulary as metadata (~100k strings for SmolLM2), so opening the
135M default model takes 7-11 s on a 2-core machine before a single weight is touched. We only
need the tensor index, so we walk the header with `struct` (skipping array contents) and keep the
rest of the format knowledge (type ids, block sizes, dequantization) in the `gguf` package.

Tensor bytes are read with plain file reads rather than a memory map: a file truncated or replaced
under a live mmap kills the process with SIGBUS, while a short read is an exception we can name.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from engine.errors import ModelLoadError
from engine.layers.int4 import Q4Blocks
from engine.layers.q8 import Q8Blocks
from engine.models.gguf_blocks import blocks_of

_SUPPORTED_VERSIONS = (2, 3)  # v1 stored counts in 32 bits and is long gone
_MAX_DIMS = 4  # GGML_MAX_DIMS

# Fixed-size metadata value types -> little-endian struct format.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip

# GGUF tensor name (without .weight/.bias) -> Hugging Face module name, for Llama/Qwen2/Qwen3.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture-of-experts layer's router (Qwen3-MoE)
}
# A MoE layer's experts, stacked `[experts, rows, cols]` in one GGUF tensor each: yielded as the
# per-expert tensors a Hugging Face checkpoint has (`mlp.experts.<e>.<proj>.weight`).
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
EXPERTS = "*"  # the expert index in a stacked tensor's name (`gguf_to_hf_name`)
# Phi-3's fused projections, as llama.cpp names them (its `ffn_up` is the gate|up pair).
_PHI3_NAMES = _BLOCK_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma 2/3's sandwich norms: llama.cpp's `ffn_norm` is the norm before the MLP there (not after
# attention, as in Llama), and the norms after attention and after the MLP have their own names.
_GEMMA_NAMES = _BLOCK_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_NAMES = {"phi3": _PHI3_NAMES, "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES}
# Gemma's RMSNorm scales by (1 + w); llama.cpp's by w, so its converter stores every norm weight
# plus one (`*norm.weight`, q/k norms included): taken back off here, as transformers does.
_NORM_PLUS_ONE_ARCHS = {"gemma2", "gemma3"}
# Tensors llama.cpp stores that are not model parameters (RoPE tables it can recompute; Phi-3's
# longrope factors, which go into the config: gguf_config._complete_phi3).
_NON_PARAMETERS = {"rope_freqs", "attn_rot_embd", "rope_factors_long", "rope_factors_short"}
# GGUF architectures whose q/k projections llama.cpp's converter permuted (rotary-pair layout).
_PERMUTED_ARCHS = {"llama"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor's bytes live and how they are stored."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch/numpy order: GGUF lists dims innermost-first, this is reversed
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """A GGUF file's header: scalar metadata and the tensor table, validated against the file size."""

    path: Path
    metadata: dict[str, Any]  # scalar and string values only; arrays (the vocabulary) are skipped
    tensors: tuple[GGUFTensorInfo, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


class _Truncated(Exception):
    """The header claims more bytes than the file has."""


class _Cursor:
    """Sequential little-endian reads from a file, bounds-checked against its size."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, file has {self.size}")
        data = self.f.read(n)
        if len(data) != n:
            raise _Truncated(f"short read at offset {self.pos}")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        if n < 0 or n > self.size - self.pos:
            raise _Truncated(f"needs {n} bytes at offset {self.pos}, file has {self.size}")
        self.f.seek(n, 1)
        self.pos += n

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType) -> Any:
        """One metadata value; arrays are skipped (returned as None) since only scalars matter here."""
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = _value_type(self.unpack("<I")), self.unpack("<Q")
            if item_type in _SCALAR_FORMATS:
                self.skip(count * struct.calcsize(_SCALAR_FORMATS[item_type]))
            else:
                for _ in range(count):
                    if item_type == GGUFValueType.STRING:
                        self.skip(self.unpack("<Q"))
                    else:
                        self.value(item_type)
            return None
        raise ValueError(f"unknown metadata value type {vtype}")


def _value_type(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"unknown metadata value type {raw}") from None


def read_gguf_index(path: Path) -> GGUFIndex:
    """Parse and validate the header; any corruption or truncation becomes a ModelLoadError.

    Validating every tensor's byte range here means a truncated download fails at resolve time,
    before transformers spends seconds parsing the same file for the config.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            return _parse_index(path, _Cursor(f, size))
    except _Truncated as e:
        raise ModelLoadError(f"GGUF file {path} is truncated or corrupt ({e})") from None
    except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"GGUF file {path} is corrupt: {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _parse_index(path: Path, cur: _Cursor) -> GGUFIndex:
    if cur.unpack("<I") != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    version = cur.unpack("<I")
    if version not in _SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        raise ValueError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    if n_tensors > cur.size or n_kv > cur.size:  # each entry takes at least one byte
        raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        value = cur.value(_value_type(cur.unpack("<I")))
        if value is not None:
            metadata[key] = value

    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = [cur.unpack("<Q") for _ in range(n_dims)]
        raw_infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}")
    data_start = -(-cur.pos // alignment) * alignment

    tensors, seen = [], set()
    for name, dims, raw_type, rel_offset in raw_infos:
        if name in seen:
            raise ValueError(f"duplicate tensor {name!r}")
        seen.add(name)
        tensors.append(_tensor_info(name, dims, raw_type, data_start + rel_offset, cur.size))
    return GGUFIndex(path=path, metadata=metadata, tensors=tuple(tensors))


def _tensor_info(name: str, dims: list[int], raw_type: int, offset: int, file_size: int) -> GGUFTensorInfo:
    try:
        qtype = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has unknown ggml type {raw_type}") from None
    shape = tuple(int(d) for d in reversed(dims))
    if shape[-1] % block_size:
        raise ValueError(f"tensor {name!r} row of {shape[-1]} is not a multiple of {qtype.name} blocks")
    n_bytes = math.prod(shape) // block_size * type_size  # Python ints: no overflow on corrupt dims
    if offset + n_bytes > file_size:
        raise _Truncated(f"tensor {name!r} ends at byte {offset + n_bytes}, file has {file_size}")
    return GGUFTensorInfo(name=name, qtype=qtype, shape=shape, offset=offset, n_bytes=n_bytes)


def gguf_to_hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """Hugging Face parameter name for a GGUF tensor name; None for tensors that are not parameters.
    A stacked experts tensor names them all with `EXPERTS` for the index (`mlp.experts.*.up_proj.weight`).

    Raises ValueError for a name we do not know, so a model we only half understand is never loaded.
    """
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    parts = base.split(".")
    if parts[-1] in _NON_PARAMETERS:
        return None
    if len(parts) == 1 and base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    names = _ARCH_NAMES.get(architecture, _BLOCK_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}.{kind}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _EXPERT_STACKS and kind == "weight":
        return f"model.layers.{int(parts[1])}.mlp.experts.{EXPERTS}.{_EXPERT_STACKS[parts[2]]}.weight"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rotary(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (HF's rotate-half pairs -> ggml's interleaved pairs).

    The converter reshapes rows to (heads, 2, half) and swaps the last two axes; this reads the rows
    as (heads, half, 2) and swaps back. Works for weights (2-D) and biases (1-D) alike.
    """
    rows = t.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows do not split into {n_heads} heads of rotary pairs")
    return t.reshape(n_heads, rows // n_heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _read_bytes(f: BinaryIO, info: GGUFTensorInfo) -> np.ndarray:
    """One tensor's raw bytes, shaped as its blocks (rows, blocks per row * bytes per block)."""
    raw = np.empty(info.n_bytes, dtype=np.uint8)
    f.seek(info.offset)
    if f.readinto(memoryview(raw)) != info.n_bytes:
        raise _Truncated(f"tensor {info.name!r} is cut short")
    return raw.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))


def _dequantize(blocks: np.ndarray, info: GGUFTensorInfo) -> torch.Tensor:
    """Dequantize a tensor's bytes to float32 in its torch shape."""
    try:
        values = dequantize(blocks, info.qtype)
    except NotImplementedError:
        raise ValueError(f"tensor {info.name!r} has type {info.qtype.name}, which cannot be dequantized") from None
    values = np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
    return torch.from_numpy(values)


def read_gguf_tensor(index: GGUFIndex, name: str) -> torch.Tensor | None:
    """One tensor by its GGUF name, dequantized to float32 (None when the file has none)."""
    info = next((t for t in index.tensors if t.name == name), None)
    if info is None:
        return None
    try:
        with index.path.open("rb") as f:
            return _dequantize(_read_bytes(f, info), info)
    except _Truncated as e:
        raise ModelLoadError(f"GGUF file {index.path} is truncated ({e})") from None
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"GGUF file {index.path}: {e}") from e


def iter_gguf_weights(index: GGUFIndex, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) one at a time, in file order.

    `num_heads`/`num_kv_heads` size the q/k un-permutation, which only applies to GGUF "llama"
    files (Qwen2/Qwen3 are converted without it). There is no lm_head when the file has no
    `output.weight` (tied embeddings): the caller ties it to the embedding.
    """
    for name, tensor, _ in iter_gguf_tensors(index, num_heads, num_kv_heads, with_q4=False):
        yield name, tensor


def iter_gguf_tensors(
    index: GGUFIndex, num_heads: int, num_kv_heads: int, *, with_q4: bool
) -> Iterator[tuple[str, torch.Tensor, Q4Blocks | Q8Blocks | None]]:
    """As `iter_gguf_weights`, plus, when `with_q4`, the blocks a quantized kernel reads
    (gguf_blocks.blocks_of: same rows as the dense tensor, un-permuted alike); None for every
    other tensor.
    """
    unpermute = index.architecture in _PERMUTED_ARCHS
    norm_plus_one = index.architecture in _NORM_PLUS_ONE_ARCHS
    path = index.path
    try:
        f = path.open("rb")
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    with f:
        for info in index.tensors:
            try:
                hf_name = gguf_to_hf_name(info.name, index.architecture)
                if hf_name is None:
                    continue
                blocks = _read_bytes(f, info)
                tensor = _dequantize(blocks, info)
                q4 = blocks_of(blocks, info.qtype, info.shape, hf_name) if with_q4 else None
                heads = None
                if unpermute and ".self_attn.q_proj." in hf_name:
                    heads = num_heads
                elif unpermute and ".self_attn.k_proj." in hf_name:
                    heads = num_kv_heads
                if norm_plus_one and hf_name.endswith("norm.weight"):
                    tensor = tensor - 1
                if heads is not None:
                    tensor = _unpermute_rotary(tensor, heads)
                    if q4 is not None:
                        q4 = q4.map_rows(lambda t, heads=heads: _unpermute_rotary(t, heads))
            except _Truncated as e:
                raise ModelLoadError(f"GGUF file {path} is truncated ({e})") from None
            except (ValueError, OSError) as e:
                raise ModelLoadError(f"GGUF file {path}: {e}") from e
            if f".experts.{EXPERTS}." in hf_name:  # one tensor per expert, each with its blocks
                per_expert = blocks.reshape(tensor.shape[0], -1) if with_q4 else None
                shape = tuple(tensor.shape[1:])
                for e in range(tensor.shape[0]):
                    name = hf_name.replace(f".{EXPERTS}.", f".{e}.")
                    q4 = None if per_expert is None else blocks_of(per_expert[e], info.qtype, shape, name)
                    yield name, tensor[e], q4
                continue
            yield hf_name, tensor, q4
