"""A process group between a trainer and the engine for weight updates (SGLang's
/init_weights_update_group + /update_weights_from_distributed).

The trainer is rank 0 and hosts the rendezvous store; the engine's tensor-parallel ranks join as
ranks `rank_offset + tp_rank`. The group is standalone (its own store and gloo/NCCL backend), so it
needs no default process group and lives beside the engine's own tensor-parallel group; its store
keys are prefixed with the group's name, as torch's own groups are. A trainer joins with
`join_weight_update_group(..., rank=0)` and sends with `broadcast_weights`, in the order of the
names it passed to /update_weights_from_distributed.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from engine.errors import InvalidRequestError

WEIGHT_SYNC_BACKENDS = ("gloo", "nccl")
DEFAULT_TIMEOUT_S = 300.0  # the rendezvous and each broadcast (a trainer may be slow to send)


def join_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the group; returns once every rank has joined."""
    if backend not in WEIGHT_SYNC_BACKENDS:
        raise InvalidRequestError(
            f"backend must be one of {', '.join(WEIGHT_SYNC_BACKENDS)}, got {backend!r}", "backend"
        )
    if not 0 <= rank < world_size:
        raise InvalidRequestError(f"rank {rank} is outside a group of {world_size}", "rank_offset")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(f"{group_name}/", store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, rank, world_size)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def broadcast_weights(group: dist.ProcessGroup, tensors: Iterable[torch.Tensor]) -> None:
    """Trainer side: send each tensor to every engine rank, in order."""
    for tensor in tensors:
        _broadcast(group, tensor.contiguous())


def parse_dtype(name: str) -> torch.dtype:
    """ "bfloat16" or "torch.bfloat16" (SGLang's requests carry either) -> torch.bfloat16."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidRequestError(f"not a floating-point torch dtype: {name!r}", "dtypes")
    return dtype


def check_weight_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
    """The request's description of what will be broadcast, checked before anyone waits on it."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise InvalidRequestError("names, dtypes and shapes must be non-empty lists of one length", "names")
    for dtype in dtypes:
        parse_dtype(dtype)
    for shape in shapes:
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidRequestError(f"a shape must be a list of sizes, got {shape!r}", "shapes")


def receive_weights(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: torch.device,
) -> list[tuple[str, torch.Tensor]]:
    """Engine side: every tensor the trainer broadcasts, named, in order. Received whole before
    any is checked against the model, so a refused update still leaves the trainer's sends
    complete (never a trainer blocked on a broadcast nobody takes)."""
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=parse_dtype(dtype), device=device)
        _broadcast(group, tensor)
        out.append((name, tensor))
    return out
