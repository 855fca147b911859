"""The ModelRunner's weights and memory changed while serving (the RL rollout controls): new
weights from a checkpoint or from tensors, and the KV pool and weights released and resumed.
A base class of ModelRunner; everything runs between forwards, on the forward's thread (the
scheduler actor launches it on the device stream with nothing in flight).
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from engine.distributed.step_message import TPRunnerCall, TPUpdateTensors, TPUpdateWeights, encode
from engine.distributed.weight_sync import join_weight_update_group, parse_dtype, receive_weights
from engine.errors import InvalidRequestError, ModelLoadError
from engine.host_memory import trim_host_memory
from engine.model_config import ModelConfig
from engine.models.loader import resolve_model
from engine.models.weight_update import apply_staged, check_same_model, stage_tensor_update

if TYPE_CHECKING:
    from engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class RunnerWeights:
    """Needs the runner's `model`, `source`, `model_config`, `kv_cache`, `tp`, `device`,
    `q4_max_tokens`, `q4_requested`, `use_cuda_graph`, `graph_runner`, `_load_model`, `_init_fused_decode` and
    `_init_cuda_graphs`."""

    model: LlamaForCausalLM | None
    weight_update_groups: dict[str, torch.distributed.ProcessGroup]  # by name (the runner's __init__)

    def update_weights_from_disk(self, model_path: str) -> None:
        """Serve the weights of the checkpoint at `model_path` (the same architecture and shapes):
        loaded as a new model beside the old one, which keeps serving if anything fails. Between
        forwards, on the forward's thread; the caller flushes the prefix cache. Under tensor
        parallelism rank 0 sends the path to the other ranks, each loads its own shard, and all
        swap only if every rank loaded it."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.broadcast_bytes(encode(TPUpdateWeights(model_path)))
        error: ModelLoadError | None = None
        try:
            source = resolve_model(model_path)
            new_cfg = ModelConfig.from_hf(source.hf_config, source.architecture, source.generation_eos)
            check_same_model(self.model_config, self.source.hf_config, new_cfg, source.hf_config)
            model, _ = self._load_model(self.q4_requested, source)
        except Exception as e:  # every rank must get here, to agree below
            error = e if isinstance(e, ModelLoadError) else ModelLoadError(f"cannot load {model_path}: {e}")
        self._agree(error, model_path)
        self.model, self.source = model, source
        self._weights_changed()

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Overwrite the named weights (Hugging Face names, any subset, whole tensors); returns
        how many were given. Everything is checked before any live weight changes. Under tensor
        parallelism rank 0 broadcasts them and each rank keeps its shard; all apply, or none."""
        self.update_weights_from_tensor_check()
        named = list(named_tensors)
        if self.tp.size > 1:
            for name, tensor in named:  # checked here: a send the others cannot take would hang them
                if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                    raise InvalidRequestError(f"weight {name} must be a floating-point tensor", "named_tensors")
            names, tensors = [n for n, _ in named], [t for _, t in named]
            spec = TPUpdateTensors(names, [str(t.dtype) for t in tensors], [list(t.shape) for t in tensors])
            self.tp.broadcast_bytes(encode(spec))
            for _, tensor in named:
                self.tp.broadcast_tensor(tensor.detach().to("cpu").contiguous())
        return self._apply_tensors(named)

    def receive_tensor_update(self, spec: TPUpdateTensors) -> int:
        """Ranks 1..N-1: rank 0's `update_weights_from_tensor`, its tensors as it broadcasts them."""
        named = [
            (name, self.tp.broadcast_tensor(torch.empty(tuple(shape), dtype=parse_dtype(dtype))))
            for name, dtype, shape in zip(spec.names, spec.dtypes, spec.shapes, strict=True)
        ]
        return self._apply_tensors(named)

    def _apply_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        error, staged = None, None
        try:
            staged = stage_tensor_update(self.model, named, self.q4_max_tokens)
        except Exception as e:  # every rank must get here, to agree below
            error = e if isinstance(e, (ModelLoadError, InvalidRequestError)) else ModelLoadError(str(e))
        self._agree(error, "the tensors")
        assert staged is not None
        apply_staged(self.model, staged)
        self._weights_changed()
        return staged.num_tensors

    def _agree(self, error: Exception | None, what: str) -> None:
        """Raise `error`, or (tensor parallelism) another rank's: every rank swaps, or none."""
        if self.tp.size > 1:
            failed = [e for e in self.tp.all_gather_object(None if error is None else str(error)) if e is not None]
            if failed and error is None:
                error = ModelLoadError(f"another tensor-parallel rank could not load {what}: {failed[0]}")
        if error is not None:
            raise error

    def update_weights_from_tensor_check(self) -> None:
        if self.model is None:
            raise InvalidRequestError("the weights are released: resume them (or load a checkpoint) first", "tags")

    def _weights_changed(self) -> None:
        """Rebuild what holds the weights' or the KV pool's tensors: the fused decode loop and the
        decode graphs (once both exist)."""
        self.graph_runner = None
        if self.model is None or self.kv_cache.released:
            return
        self.model.fused_decode = None
        self._init_fused_decode()
        if self.use_cuda_graph:
            torch.cuda.empty_cache()
            self.graph_runner = self._init_cuda_graphs()

    # ---- memory release / resume (SGLang's release_memory_occupation) -------------------------

    def release_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Free the KV pool ("kv_cache") and/or the weights ("weights"), with no request holding
        memory; the memory goes back to the OS (CPU: the pages are unmapped, then malloc_trim)
        or the device. Between forwards, on the forward's thread."""
        self._tell_ranks("release_memory_occupation", tags=list(tags))
        self.graph_runner = None
        if self.model is not None:
            self.model.fused_decode = None
        if "kv_cache" in tags:
            self.kv_cache.release()
        if "weights" in tags:
            self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_host_memory()

    def resume_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Bring back what `release_memory_occupation` freed: the KV pool zeroed, the weights
        reloaded from the checkpoint last loaded from disk."""
        self._tell_ranks("resume_memory_occupation", tags=list(tags))
        if "weights" in tags and self.model is None:
            model, error = None, None
            try:
                model, _ = self._load_model(self.q4_requested)
            except Exception as e:  # every rank must get here, to agree below
                error = e if isinstance(e, ModelLoadError) else ModelLoadError(str(e))
            self._agree(error, "the weights")
            self.model = model
        if "kv_cache" in tags and self.kv_cache.released:
            self.kv_cache.restore()
        self._weights_changed()

    # ---- a trainer's weight-update group (engine/distributed/weight_sync.py) -------------------

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> None:
        """Join the trainer's group as rank `rank_offset + tp rank` (blocks until all have joined:
        the trainer and every rank of this engine)."""
        self._tell_ranks(
            "init_weights_update_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        groups = self.weight_update_groups
        if group_name in groups:
            raise InvalidRequestError(f"weight update group {group_name!r} exists already", "group_name")
        groups[group_name] = join_weight_update_group(
            master_address, master_port, rank_offset + self.tp.rank, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> int:
        """Receive the trainer's broadcast of these tensors (every rank takes them whole from the
        trainer), then apply them as `update_weights_from_tensor` does (all checked before any
        weight changes, on every rank or none)."""
        self._tell_ranks(
            "update_weights_from_distributed", group_name=group_name, names=names, dtypes=dtypes, shapes=shapes
        )
        group = self.weight_update_groups.get(group_name)
        if group is None:
            raise InvalidRequestError(
                f"no weight update group {group_name!r}: call init_weights_update_group", "group_name"
            )
        tensors = receive_weights(group, names, dtypes, shapes, self.device)
        return self._apply_tensors(tensors)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self._tell_ranks("destroy_weights_update_group", group_name=group_name)
        if self.weight_update_groups.pop(group_name, None) is None:
            raise InvalidRequestError(f"no weight update group {group_name!r}", "group_name")

    def _tell_ranks(self, method: str, **kwargs: object) -> None:
        """Rank 0 of a tensor-parallel group: the other ranks make the same call (worker.py)."""
        if self.tp.size > 1 and self.tp.is_driver:
            self.tp.broadcast_bytes(encode(TPRunnerCall(method, kwargs)))
