"""Triton attention kernels over the token-level KV pool (SGLang-style), one module per job.

The pool is `k_buffer` / `v_buffer` of shape `[num_slots, KVH, D]`; `req_to_token[row, pos]` is the
slot holding position `pos` of the request in table row `row`. Every position is looked up through
that table, so nothing assumes a request's slots are contiguous (page size 1, shuffled slots and
paged layouts all work the same). All kernels accumulate in fp32; operands may be fp32, fp16 or bf16.

- `store_kv.py`: scatter the new tokens' K/V into their pool slots;
- `decode.py`: split-KV flash decoding (`decode_attention_fwd`);
- `extend.py`: prefill over a cached prefix plus the new tokens (`extend_attention_fwd`);
- `common.py`: the interpreter switch, launch checks and the shared online-softmax step.

Importing this package needs `triton` but no GPU. Launching needs CUDA tensors, or
`TRITON_INTERPRET=1` set before this package is first imported (the interpreter runs the kernels on
CPU with numpy; that is how the tests run them). Otherwise the wrappers raise RuntimeError.
"""

from __future__ import annotations

from engine.kernels.triton_attention.common import INTERPRET
from engine.kernels.triton_attention.decode import decode_attention_fwd, decode_stage1_kernel, decode_stage2_kernel
from engine.kernels.triton_attention.extend import extend_attention_fwd, extend_kernel
from engine.kernels.triton_attention.store_kv import store_kv, store_kv_kernel

__all__ = [
    "INTERPRET",
    "decode_attention_fwd",
    "decode_stage1_kernel",
    "decode_stage2_kernel",
    "extend_attention_fwd",
    "extend_kernel",
    "store_kv",
    "store_kv_kernel",
]
