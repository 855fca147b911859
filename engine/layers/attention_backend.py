"""Which attention backend a ModelRunner builds (`ServerArgs.attention_backend`).

- "torch": `TorchAttnBackend`, everywhere (the reference; the CPU path).
- "triton": `TritonAttnBackend`. Its kernels run on CUDA tensors, or on CPU only under the Triton
  interpreter (`TRITON_INTERPRET=1` set before the kernels module is first imported; tests use it).
- "auto": triton on a CUDA device when the triton package imports, torch otherwise.

Why decide here, at construction: choosing triton where its kernels cannot launch would otherwise
surface as a RuntimeError deep inside the first forward pass (after the model and the KV pool were
built); a typed `InvalidRequestError(param="attention_backend")` at startup names the option and
the fix instead.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from engine.errors import InvalidRequestError
from engine.layers.attention_torch import TorchAttnBackend
from engine.layers.attention_triton import TritonAttnBackend

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "triton")
AttnBackend = TorchAttnBackend | TritonAttnBackend

_KERNELS = "engine.kernels.triton_attention"


def _triton_problem() -> str | None:
    """Why the triton package cannot be used here, or None when it imports."""
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an unusable install is "no triton", whatever it raises
        return f"the triton package does not import ({type(e).__name__}: {e})"
    return None


def _interpreter_on() -> bool:
    """True when the Triton kernels run (or will run) under the interpreter.

    The kernels module fixes this when it is first imported; before that the environment decides.
    """
    kernels = sys.modules.get(_KERNELS)
    if kernels is not None:
        return bool(kernels.INTERPRET)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """"torch" or "triton" for this device; raises InvalidRequestError when the choice cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise InvalidRequestError(
            f"unknown attention backend {requested!r}; use one of {list(ATTENTION_BACKENDS)}", "attention_backend"
        )
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device.type != "cuda":
            return "torch"
        problem = _triton_problem()
        if problem is not None:
            log.warning("attention backend auto: %s; using the torch backend", problem)
            return "torch"
        return "triton"
    problem = _triton_problem()
    if problem is not None:
        raise InvalidRequestError(f"attention backend 'triton' needs triton: {problem}", "attention_backend")
    if device.type != "cuda" and not _interpreter_on():
        raise InvalidRequestError(
            f"attention backend 'triton' runs on CUDA devices; on {device.type} use 'torch' (or set "
            "TRITON_INTERPRET=1 before start-up to run the kernels in Triton's CPU interpreter, for tests)",
            "attention_backend",
        )
    return "triton"


def create_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float, cascade: bool = True
) -> AttnBackend:
    """The backend object for a name returned by `resolve_attention_backend`."""
    if name == "triton":
        return TritonAttnBackend(num_heads, num_kv_heads, head_dim, scaling)
    if name == "torch":
        return TorchAttnBackend(num_heads, num_kv_heads, head_dim, scaling, cascade=cascade)
    raise ValueError(f"unresolved attention backend {name!r}")
