"""New values for a loaded model's weights (SGLang's update_weights_from_disk / _from_tensor).

A weight update must never leave a half-updated model serving: everything that can fail (an
unknown name, a wrong shape, a non-float tensor, a checkpoint of another architecture) fails while
the new values are *staged*, off to the side, before any live tensor is touched; `apply_staged`
then only copies and swaps, which cannot fail.

Projections run in derived forms (oneDNN-prepacked, 4-bit + dense; engine/layers/linear.py), so a
new value cannot simply be copied in: each projection a tensor touches is rebuilt from its dense
weight (recovered exactly from whatever form it runs as, `dense_weight`), with the given parts
overwritten, and finalized again. An updated projection runs dense (prepacked where that applies):
new values come without 4-bit blocks, and quantizing a trainer's weights would serve other
numbers than the trainer's. A MoE layer's expert tensors (engine/layers/moe.py) run from their
stacked weights as they are: each is staged whole and copied into its rows, and the layer drops
its experts in blocks (it runs dense from then on, as an updated projection does). A whole new
checkpoint on disk is loaded as a new model instead (`ModelRunner.update_weights_from_disk`),
which keeps a GGUF's quantized forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.distributed.sharding import VOCAB_PARALLEL
from engine.errors import InvalidRequestError, ModelLoadError
from engine.layers.linear import BatchInvariantLinear, DenseLinear, Linear, dense_weight, finalize_linear
from engine.layers.moe import FusedMoE
from engine.model_config import ModelConfig
from engine.models.checkpoint_parts import WeightItem, llama_layout
from engine.models.llama import EXPERT, PARAM, PART, SKIP, UNKNOWN, LlamaForCausalLM

# ModelConfig fields a new checkpoint may change: everything else fixes shapes or numerics the
# running model was built for (the KV pool, the kernels, the rotary tables).
_MAY_DIFFER = {"eos_token_ids", "context_len"}
# hf_config entries outside ModelConfig that the model was built from (the rotary tables)
_ROTARY_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor")


def check_same_model(old: ModelConfig, old_hf: object, new: ModelConfig, new_hf: object) -> None:
    """A new checkpoint must be the served model with other values: a ModelLoadError names what differs."""
    diffs = [
        f"{f.name}: {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _MAY_DIFFER and getattr(old, f.name) != getattr(new, f.name)
    ]
    diffs += [
        f"{key}: {getattr(old_hf, key, None)!r} -> {getattr(new_hf, key, None)!r}"
        for key in _ROTARY_KEYS
        if getattr(old_hf, key, None) != getattr(new_hf, key, None)
    ]
    if diffs:
        raise ModelLoadError("the new weights are not the served model's architecture and shapes: " + "; ".join(diffs))


@dataclass
class StagedWeights:
    """Checked new values, not yet live: parameters by path, and rebuilt projection modules."""

    params: dict[str, torch.Tensor] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    experts: dict[tuple[str, int, str], torch.Tensor] = field(default_factory=dict)  # (MoE path, expert, proj)
    num_tensors: int = 0


def stage_tensor_update(
    model: LlamaForCausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]], q4_rows: int
) -> StagedWeights:
    """Check Hugging Face-named tensors against `model` and build what they change (see the
    module docstring); the model itself is untouched. Any subset of the weights may be given
    (a trainer sends its parameters in buckets); a name given twice keeps the last value."""
    params = dict(model.named_parameters())
    parts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    staged = StagedWeights()
    for name, tensor, _ in llama_layout(_rank_parts(model, named_tensors), model.cfg, model.shard):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise InvalidRequestError(f"weight {name} must be a floating-point tensor", "named_tensors")
        target = model.weight_target(name)
        staged.num_tensors += 1
        if target.kind == UNKNOWN:
            raise ModelLoadError(f"unexpected weight {name} for {model.cfg.architecture}")
        if target.kind == SKIP:
            continue
        if target.kind == PARAM:
            tensor = _vocab_padded(name, tensor, params[target.path].shape[0])
            _check_shape(name, tensor, tuple(params[target.path].shape))
            staged.params[target.path] = tensor
            continue
        if target.kind == EXPERT:
            moe = model.get_submodule(target.path)
            assert isinstance(moe, FusedMoE)
            _check_shape(name, tensor, moe.expert_shape(target.attr))
            staged.experts[(target.path, target.part, target.attr)] = tensor
            continue
        assert target.kind == PART
        linear = model.get_submodule(target.path)
        rows = linear.output_sizes[target.part]
        tensor = _vocab_padded(name, tensor, rows)
        if target.attr == "bias" and linear.bias is None:
            raise ModelLoadError(f"unexpected weight {name} for {model.cfg.architecture}")
        _check_shape(name, tensor, (rows, linear.in_features) if target.attr == "weight" else (rows,))
        parts.setdefault(target.path, {})[(target.attr, target.part)] = tensor
    for path, given in parts.items():
        staged.modules[path] = _rebuilt(model.get_submodule(path), given, q4_rows)
    if model.cfg.tie_word_embeddings and "embed_tokens.weight" in staged.params:
        # the LM head is the embedding table: its derived form follows the new table
        head = model.lm_head
        weight = staged.params["embed_tokens.weight"].to(model.embed_tokens.weight.dtype)
        staged.modules["lm_head"] = _rebuilt(head, {("weight", 0): weight}, q4_rows)
    return staged


def apply_staged(model: LlamaForCausalLM, staged: StagedWeights) -> None:
    """Make staged values live (between forwards, on the forward's thread). The caller rebuilds
    what holds the old modules' tensors (the fused decode loop, CUDA graphs)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for path, value in staged.params.items():
            params[path].copy_(value)
        for (path, expert, proj), value in staged.experts.items():
            moe = model.get_submodule(path)
            assert isinstance(moe, FusedMoE)
            moe.drop_quantized()  # dense experts again (the blocks' values), then the new values in
            moe.expert_weight(expert, proj).copy_(value)
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.pack_router()  # its prepacked router follows `gate`
    for path, module in staged.modules.items():
        model.set_submodule(path, module)
    head = model.lm_head
    if model.cfg.tie_word_embeddings and isinstance(head, DenseLinear):
        head.weight = model.embed_tokens.weight  # tied again: one table for the lookup and the head
    for layer in model.layers:  # Qwen3's per-head table is built from the q/k norm weights
        if layer.self_attn.qk_norm is not None:
            layer.self_attn.qk_norm.process_weights_after_loading()


def _rank_parts(model: LlamaForCausalLM, named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[WeightItem]:
    """Each whole tensor cut to this rank's part (tensor parallelism; a fused checkpoint tensor is
    cut by `llama_layout`), as a checkpoint is read: a row-parallel bias is rank 0's only."""
    shard = model.shard
    for name, tensor in named:
        part = shard.weight_slice(name) if isinstance(tensor, torch.Tensor) else None
        if part is not None:
            dim, start, stop = part
            if tensor.dim() <= dim or tensor.shape[dim] < stop:
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}: too small to split over the ranks"
                )
            tensor = tensor.narrow(dim, start, stop - start)
        if shard.zero_bias(name):
            tensor = torch.zeros_like(tensor)
        yield name, tensor, None


def _vocab_padded(name: str, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The last vocabulary shard holds zero rows past the real vocabulary (as loading leaves them)."""
    if name in VOCAB_PARALLEL and tensor.dim() == 2 and tensor.shape[0] < rows:
        return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], tensor.shape[1])])
    return tensor


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {expected}")


def _rebuilt(live: Linear, given: dict[tuple[str, int], torch.Tensor], q4_rows: int) -> nn.Module:
    """`live`'s projection with the given parts' new values, in its final form."""
    weight = dense_weight(live).clone()
    dense = DenseLinear(
        live.in_features,
        live.output_sizes,
        live.bias is not None,
        weight.device,
        weight.dtype,
        weight=nn.Parameter(weight, requires_grad=False),
    )
    with torch.no_grad():
        if live.bias is not None:
            dense.bias.copy_(live.bias)
        for (attr, part), tensor in given.items():
            first, rows = dense.shard_rows(part)
            getattr(dense, attr)[first : first + rows].copy_(tensor)
    return finalize_linear(dense, None, q4_rows, live.tiles if isinstance(live, BatchInvariantLinear) else None)
