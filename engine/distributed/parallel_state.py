"""The tensor-parallel group: which rank this process is, and the few collectives TP needs.

Built on `torch.distributed`, nothing home-made: gloo on a CPU, NCCL on CUDA (with a second,
gloo group for the host-side step messages, as SGLang keeps a CPU group beside its device
group). One object is handed to the model and the runner; at size 1 (`TPGroup.single()`) every
collective is the identity, so the single-process path pays one Python call per layer and
nothing else.

What crosses ranks each step (engine/distributed/ARCHITECTURE in docs/ARCHITECTURE.md):
- rank 0 -> all: the step message (`broadcast_bytes`, the CPU group);
- all <-> all: two all-reduces per layer (attention output, MLP output) and one for the
  vocab-parallel embedding (`all_reduce`);
- all -> rank 0: the logits' vocabulary shards (`gather_vocab`);
- rank 0 -> all: the sampled ids (`broadcast_ids`), which the other ranks keep for the next
  overlapped decode.

Any failure of a collective (a rank died, the rendezvous timed out) is raised as
`DistributedError`: the engine treats it as fatal, since the group cannot be repaired in place.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from engine.errors import DistributedError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Step collectives wait this long at most (a worker idles in one between requests): in effect never.
STEP_TIMEOUT = datetime.timedelta(days=365)


def _guarded(what: str, fn: Callable[[], T]) -> T:
    """Run one collective; a backend failure becomes a DistributedError naming it."""
    try:
        return fn()
    except DistributedError:
        raise
    except (RuntimeError, ValueError) as e:  # DistBackendError is a RuntimeError
        raise DistributedError(f"tensor-parallel {what} failed: {e}") from e


class TPGroup:
    """This process's place in the tensor-parallel group and its collectives."""

    def __init__(
        self,
        rank: int,
        size: int,
        local_size: int = 1,
        device_group: dist.ProcessGroup | None = None,
        cpu_group: dist.ProcessGroup | None = None,
        ep_size: int = 1,
    ) -> None:
        self.rank = rank
        self.size = size
        # expert parallelism inside the group (SGLang's --ep-size): a MoE layer's experts split
        # over ep_size sets of size/ep_size ranks (engine/distributed/sharding.py)
        self.ep_size = ep_size
        self.local_size = local_size  # ranks on this host (they share its memory and cores)
        self.device_group = device_group
        self.cpu_group = cpu_group

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1)

    @classmethod
    def init(
        cls,
        rank: int,
        size: int,
        local_size: int,
        init_method: str,
        device: torch.device,
        rendezvous_s: float,
        ep_size: int = 1,
    ) -> TPGroup:
        """Join the group: blocks until every rank has joined, or `rendezvous_s` (then raises).

        The step collectives run on groups without a practical timeout: a worker waits for the
        next step however long the engine idles. A rank that dies is noticed at once anyway (its
        sockets close, the peers' collectives raise); one that hangs inside a forward is caught
        by rank 0's watchdog (`watchdog_timeout`), which fails the engine.
        """
        backend = "nccl" if device.type == "cuda" else "gloo"

        def join() -> TPGroup:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=rendezvous_s),
            )
            device_group = dist.new_group(backend=backend, timeout=STEP_TIMEOUT)
            cpu_group = device_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=STEP_TIMEOUT)
            return cls(rank, size, local_size, device_group, cpu_group, ep_size)

        group = _guarded(f"rendezvous at {init_method}", join)
        log.info("tensor-parallel rank %d of %d joined (%s, %s)", rank, size, backend, init_method)
        return group

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process that runs the actors and samples."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (row-parallel outputs, the vocab-parallel embedding)."""
        if self.size == 1:
            return x
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # gloo sums bf16 in bf16 pairwise; in fp32 the sum is exact to the last bf16 bit.
            total = x.float()
            _guarded("all-reduce", lambda: dist.all_reduce(total, group=self.device_group))
            x.copy_(total)
            return x
        _guarded("all-reduce", lambda: dist.all_reduce(x, group=self.device_group))
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Logits `[B, V]` on rank 0 from each rank's `[B, V/N]` shard (float32); None elsewhere.
        One rank: `local` as it is, in the model's dtype. The sampler converts where it computes
        in float32 (exactly: the greedy argmax is the same); converting every row up front cost
        ~4 ms per decode step at batch 100 (bench.step_profile, M1)."""
        if self.size == 1:
            return local
        local = local.float().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_driver else None
        _guarded("logits gather", lambda: dist.gather(local, parts, dst=0, group=self.device_group))
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., :vocab_size]

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (the others pass None), over the CPU group."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        _guarded("step broadcast", lambda: dist.broadcast(size, src=0, group=self.cpu_group))
        n = int(size.item())
        if self.is_driver:
            assert payload is not None
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        else:
            data = torch.empty(n, dtype=torch.uint8)
        if n:
            _guarded("step broadcast", lambda: dist.broadcast(data, src=0, group=self.cpu_group))
        return payload if payload is not None else data.numpy().tobytes()

    def broadcast_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU `tensor` into `tensor` on every rank (a weight update), over the CPU group."""
        _guarded("weight broadcast", lambda: dist.broadcast(tensor, src=0, group=self.cpu_group))
        return tensor

    def broadcast_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids (int64 `[B]`) into `ids` on every rank (the device group)."""
        _guarded("sampled-ids broadcast", lambda: dist.broadcast(ids, src=0, group=self.device_group))
        return ids

    def all_gather_object(self, obj: T) -> list[T]:
        """Every rank's `obj` (small start-up facts: weight bytes, pool sizes), on every rank."""
        if self.size == 1:
            return [obj]
        out: list[T] = [obj] * self.size
        _guarded("start-up exchange", lambda: dist.all_gather_object(out, obj, group=self.cpu_group))
        return out

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except (RuntimeError, ValueError) as e:  # a peer already gone: nothing left to release
                log.debug("destroy_process_group: %s", e)
