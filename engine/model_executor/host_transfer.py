"""Small host<->device copies of one forward step, without stalling the launching thread.

Why: every step builds a few small index tensors on the host (request rows, sequence lengths, KV
slots, positions). `tensor.to("cuda")` from ordinary (pageable) memory is a synchronous copy: the
CPU waits, and under the overlap scheduler that wait happens on the event-loop thread. Copying
from page-locked (pinned) memory with `non_blocking=True` only enqueues the copy on the current
stream, behind the work already there, and returns at once.

- `host_to_device(tensors, device)`: CPU tensors of one dtype are packed into one pinned buffer
  and moved with one non-blocking copy; each caller gets a device view of its rows. A forward's
  inputs all go through one call, in `ForwardBatch.init_new`. Tensors
  already on the device pass through. On a CPU device nothing happens at all (CPU runs unchanged).
- `DeviceToHost.start(t)`: the reverse for the sampled ids: a non-blocking copy into pinned memory
  plus an event; `result()` waits on that event only (not on the whole device) before the host
  reads the values.

Pinned buffers are taken fresh from torch's caching host allocator each time rather than reused by
hand: that allocator records the copy's stream event and does not hand the block out again until
the copy is done, so a buffer can never be overwritten while a queued copy still reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_to_device(tensors: Sequence[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """`[t.to(device) for t in tensors]`, with CPU->CUDA copies batched through pinned memory.

    `None` entries stay None. Only CPU tensors bound for a CUDA device take the pinned path; every
    other case is a plain `.to(device)` (a no-op for tensors already there).
    """
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None if t is None else t for t in tensors]
    if device.type != "cuda":
        return [None if t is None else t.to(device) for t in out]
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(out):
        if t is not None and t.device.type == "cpu":
            groups.setdefault(t.dtype, []).append(i)
    for dtype, idx in groups.items():
        flat = [out[i].reshape(-1) for i in idx]  # type: ignore[union-attr]
        staging = torch.empty(sum(f.numel() for f in flat), dtype=dtype, pin_memory=True)
        torch.cat(flat, out=staging)
        moved = staging.to(device, non_blocking=True)
        start = 0
        for i, f in zip(idx, flat):
            n = f.numel()
            out[i] = moved[start : start + n].view(out[i].shape)  # type: ignore[union-attr]
            start += n
    return [None if t is None else t.to(device) for t in out]


class DeviceToHost:
    """A device tensor's values on their way to the host: non-blocking copy + completion event.

    Built inside the forward (on the stream that produced the tensor); `result()` may be called
    from any thread later. On CPU tensors it is a plain reference and `result()` returns it.
    """

    __slots__ = ("_event", "_host")

    def __init__(self, host: torch.Tensor, event: object | None) -> None:
        self._host = host
        self._event = event

    @classmethod
    def start(cls, t: torch.Tensor) -> DeviceToHost:
        """Enqueue the copy of `t` on the current stream (CUDA) or wrap `t` (CPU)."""
        if t.device.type != "cuda":
            return cls(t, None)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def result(self) -> torch.Tensor:
        """The host tensor, once the copy has landed (waits on this copy's event only)."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
            self._event = None
        return self._host
