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
    enable_overlap: bool = True
    torch_threads: int | None = None  # threads for the forward thread (None: torch's default)

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
