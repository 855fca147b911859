"""Engine options, named as SGLang's ServerArgs names them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


@dataclass
class ServerArgs:
    model_path: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 (fast on this CPU with AMX, and on GPUs)
    device: str = "auto"  # auto: cuda when available, else cpu
    context_length: int | None = None  # default: the model's max_position_embeddings
    max_running_requests: int = 128
    max_total_tokens: int | None = None  # KV pool size in tokens; overrides mem_fraction_static
    mem_fraction_static: float | None = None  # share of free memory for the KV pool
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = 2048  # None or <= 0 disables chunking
    page_size: int = 1
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # None (auto): on for CUDA, off for CPU. On a CPU the "device" is the same cores: planning the
    # next step beside the running forward steals them (bench.overlap: 3x slower steps when the
    # machine is busy, ~20% when quiet), so there is nothing to hide the host work behind.
    enable_overlap: bool | None = None
    # GPU path (see engine/layers/attention_backend.py and engine/cuda_graph_runner.py).
    attention_backend: str = "auto"  # auto: triton on CUDA when it imports, else torch; or "torch" / "triton"
    disable_cuda_graph: bool = False  # decode CUDA graphs are used on CUDA with the triton backend
    cuda_graph_max_bs: int | None = None  # largest decode batch captured (default: min(64, max_running_requests))
    # Torch attention backend: decode attends a prefix shared by several requests of the batch
    # once for all of them (shared_prefix.py) instead of once per request.
    disable_cascade_attention: bool = False
    torch_threads: int | None = None  # threads for the forward thread (None: torch's default)
    # CPU + bf16 only: linears of inputs up to this many rows (decode batch size) use the packed
    # 4-bit kernel on a Q4_0/Q4_1 GGUF's own weights; more rows use the dense weights. 0 disables.
    # 16: the default model's decode step breaks even near 16 rows at 1 thread, 20 at 2 (2-core CPU).
    q4_max_tokens: int = 16

    def resolved_enable_overlap(self) -> bool:
        return self.resolved_device().type == "cuda" if self.enable_overlap is None else self.enable_overlap

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise InvalidRequestError(f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}", "dtype") from None

    def resolved_q4_max_tokens(self) -> int:
        """Rows up to which the packed 4-bit path runs; 0 where it does not apply (GPU, not bf16)."""
        value = self.q4_max_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidRequestError(f"q4_max_tokens must be an int >= 0, got {value!r}", "q4_max_tokens")
        if self.resolved_device().type != "cpu" or self.resolved_dtype() != torch.bfloat16:
            return 0
        return value
