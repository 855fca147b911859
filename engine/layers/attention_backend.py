"""Which attention backend a ModelRunner builds (`ServerArgs.attention_backend`), decided once.

- "cpu": `CpuAttnBackend`, the C++ paged attention kernels (+ cascade decode; Gemma 2's soft-cap
  inside them); CPU, fp32/bf16, head size 64, 128 or 256, the kernels' extension built.
- "torch": `TorchAttnBackend`, plain torch on any device (the reference).
- "triton": `TritonAttnBackend`. Its kernels run on CUDA tensors, or on CPU only under the Triton
  interpreter (`TRITON_INTERPRET=1` set before the kernels are first imported; tests use it).
- "auto": triton on a CUDA device when the triton package imports; on a CPU, cpu when the kernels
  take this dtype and head size, else torch.

Why decide here, at start-up: a backend that cannot run would otherwise surface as a RuntimeError
deep inside the first forward pass (after the model and the KV pool were built), and a backend
that re-checked its options every forward would pay for it every layer. A typed
`InvalidRequestError(param="attention_backend")` names the option and the fix instead.
`check_attention_backend` runs before anything is loaded; `resolve_attention_backend` once the
model's head size is known.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from engine.errors import InvalidRequestError
from engine.kernels import cpu_attention
from engine.layers.attention_cpu import CpuAttnBackend
from engine.layers.attention_ops import HeadLayout
from engine.layers.attention_torch import TorchAttnBackend
from engine.layers.attention_triton import TritonAttnBackend
from engine.layers.attention_window import WindowedAttnBackend
from engine.model_executor.forward_batch_info import AttentionBackend

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")

_KERNELS = "engine.kernels.triton_attention"


def triton_problem() -> str | None:
    """Why the triton package cannot be used here, or None when it imports."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # an unusable install is "no triton", whatever it raises
        return f"the triton package does not import ({type(e).__name__}: {e})"
    return None


def interpreter_on() -> bool:
    """True when the Triton kernels run (or will run) under the interpreter.

    The kernels package fixes this when it is first imported; before that the environment decides.
    """
    kernels = sys.modules.get(_KERNELS)
    if kernels is not None:
        return bool(kernels.INTERPRET)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_attention_backend(requested: str, device: torch.device) -> None:
    """Raise InvalidRequestError when `requested` cannot run on `device` whatever the model."""
    if requested not in ATTENTION_BACKENDS:
        raise InvalidRequestError(
            f"unknown attention backend {requested!r}; use one of {list(ATTENTION_BACKENDS)}", "attention_backend"
        )
    if requested == "cpu" and device.type != "cpu":
        raise InvalidRequestError(
            f"attention backend 'cpu' runs on CPUs; on {device.type} use 'auto'", "attention_backend"
        )
    if requested != "triton":
        return
    problem = triton_problem()
    if problem is not None:
        raise InvalidRequestError(f"attention backend 'triton' needs triton: {problem}", "attention_backend")
    if device.type != "cuda" and not interpreter_on():
        raise InvalidRequestError(
            f"attention backend 'triton' runs on CUDA devices; on {device.type} use 'cpu' or 'torch' (or set "
            "TRITON_INTERPRET=1 before start-up to run the kernels in Triton's CPU interpreter, for tests)",
            "attention_backend",
        )


def resolve_attention_backend(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """ "cpu", "torch" or "triton" for this device, KV dtype and head size; raises InvalidRequestError
    when the choice cannot run. May build the CPU kernels (cached after the first build)."""
    check_attention_backend(requested, device)
    if requested == "auto":
        if device.type == "cuda":
            problem = triton_problem()
            if problem is None:
                return "triton"
            log.warning("attention backend auto: %s; using the torch backend", problem)
            return "torch"
        return "cpu" if cpu_attention.available(device, dtype, head_dim) else "torch"
    if requested == "cpu" and not cpu_attention.available(device, dtype, head_dim):
        raise InvalidRequestError(
            f"attention backend 'cpu' needs the C++ CPU kernels built and a dtype in "
            f"{[str(d) for d in cpu_attention.DTYPES]}, head size in {list(cpu_attention.HEAD_DIMS)} "
            f"(got {dtype}, {head_dim}); use 'torch' or 'auto'",
            "attention_backend",
        )
    return requested


def create_attention_backend(
    name: str,
    layout: HeadLayout,
    cascade: bool = True,
    windows: tuple[int, ...] = (),
    softcap: float | None = None,
    swa_memory: bool = False,
) -> AttentionBackend:
    """The backend object for a name returned by `resolve_attention_backend`.

    `cascade` (shared-prefix decode) applies to the cpu and torch backends. A model with sliding
    windows (`windows`: one per layer, 0 = none) or an attention soft-cap gets the backend wrapped in
    `WindowedAttnBackend` (attention_window.py), which serves what the kernels do not (the cpu
    kernels take the soft-cap themselves, the Triton kernels windows and the soft-cap both);
    `swa_memory`: the local layers' KV lives in the SWA pool (engine/cache/swa_pool.py).
    """
    backend = _backend(name, layout, cascade, softcap, windows)
    if any(windows) or softcap is not None:
        # Hybrid SWA memory: the local layers plan over their own table (attention_window.py).
        swa_inner = _backend(name, layout, cascade, softcap, windows) if swa_memory else None
        return WindowedAttnBackend(backend, layout, windows, softcap, swa_inner)
    return backend


def _backend(
    name: str, layout: HeadLayout, cascade: bool, softcap: float | None, windows: tuple[int, ...]
) -> AttentionBackend:
    if name == "cpu":
        return CpuAttnBackend(layout, cascade=cascade, softcap=softcap)
    if name == "torch":
        return TorchAttnBackend(layout, cascade=cascade)
    if name == "triton":
        return TritonAttnBackend(layout, windows=windows, softcap=softcap)
    raise ValueError(f"unresolved attention backend {name!r}")
