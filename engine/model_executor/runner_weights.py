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

from engine.distributed.step_message import TPUpdateWeights, encode
from engine.distributed.weight_sync import join_weight_update_group, receive_weights
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
    `q4_max_tokens`, `use_cuda_graph`, `graph_runner`, `_load_model`, `_init_fused_decode` and
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
            model, _ = self._load_model(self.q4_max_tokens, source)
        except Exception as e:  # every rank must get here, to agree below
            error = e if isinstance(e, ModelLoadError) else ModelLoadError(f"cannot load {model_path}: {e}")
        if self.tp.size > 1:
            failed = [e for e in self.tp.all_gather_object(None if error is None else str(error)) if e is not None]
            if failed and error is None:
                error = ModelLoadError(f"another tensor-parallel rank could not load {model_path}: {failed[0]}")
        if error is not None:
            raise error
        self.model, self.source = model, source
        self._weights_changed()

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Overwrite the named weights (Hugging Face names, any subset); returns how many were
        given. Everything is checked before any live weight changes."""
        self.update_weights_from_tensor_check()
        staged = stage_tensor_update(self.model, named_tensors, self.q4_max_tokens)
        apply_staged(self.model, staged)
        self._weights_changed()
        return staged.num_tensors

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
        self._single_rank("release_memory_occupation")
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
        self._single_rank("resume_memory_occupation")
        if "weights" in tags and self.model is None:
            self.model, _ = self._load_model(self.q4_max_tokens)
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
        """Join the trainer's group as rank `rank_offset + tp rank` (blocks until all have joined)."""
        self._single_rank("init_weights_update_group")
        groups = self.weight_update_groups
        if group_name in groups:
            raise InvalidRequestError(f"weight update group {group_name!r} exists already", "group_name")
        groups[group_name] = join_weight_update_group(
            master_address, master_port, rank_offset + self.tp.rank, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]
    ) -> int:
        """Receive the trainer's broadcast of these tensors, then apply them as
        `update_weights_from_tensor` does (all checked before any weight changes)."""
        group = self.weight_update_groups.get(group_name)
        if group is None:
            raise InvalidRequestError(
                f"no weight update group {group_name!r}: call init_weights_update_group", "group_name"
            )
        tensors = receive_weights(group, names, dtypes, shapes, self.device)
        return self.update_weights_from_tensor(tensors)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        if self.weight_update_groups.pop(group_name, None) is None:
            raise InvalidRequestError(f"no weight update group {group_name!r}", "group_name")

    def _single_rank(self, what: str) -> None:
        if self.tp.size > 1:
            raise InvalidRequestError(f"{what} is not supported under tensor parallelism yet", "tags")
