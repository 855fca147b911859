"""`apply_lora`: add the batch's LoRA deltas to one projection's output, the one call a projection makes.

    qkv = self.qkv_proj(x)
    if fb.lora is not None:
        apply_lora(x, qkv, self.layer_id, "qkv_proj", fb.lora)

For the rows of each adapter's segment (batch.py), `out[:, part p] += (x @ A_p.T * scaling_p) @ B_p.T`
for every part p of the projection (q/k/v, gate/up, or its only part): one shrink over the stacked
A's, one expand that puts each part's product in that part's columns (pool.py's layout). Base rows
are neither read nor written, so their output is bit-identical to a forward without LoRA.

Under tensor parallelism `x` and `out` are this rank's (the pool holds this rank's shards,
projections.py): a row-parallel projection's delta is a partial sum like its base output, so call
this before the layer's all-reduce.

Two implementations, chosen when the pool is built (`LoRAPool.kernel`): torch ops (CPU; one
gather, then per adapter one shrink and one expand per part, one scatter-add), and the Triton SGMV
kernels (triton_ops.py; GPU), imported only when used so CPU-only code never needs triton.
"""

from __future__ import annotations

import torch

from engine.lora.batch import LoRABatchInfo
from engine.lora.pool import LoRAWeights


def apply_lora(x: torch.Tensor, out: torch.Tensor, layer: int, projection: str, info: LoRABatchInfo) -> torch.Tensor:
    """Add the LoRA deltas of `projection` (pool.PROJECTIONS' names) in `layer` to `out` in place
    and return it. `x`: `[rows, in]`, the projection's input; `out`: `[rows, out]`, its output."""
    if info.empty:
        return out
    w = info.pool.weights(layer, projection)
    if w is None or not w.active:  # no resident adapter adapts this projection here
        return out
    if x.shape[0] != info.num_rows or out.shape[0] != info.num_rows:
        raise ValueError(f"LoRA batch info is for {info.num_rows} rows; x has {x.shape[0]}, out {out.shape[0]}")
    if info.pool.kernel == "triton":
        from engine.lora import triton_ops  # the GPU path only: see the module docstring

        return triton_ops.lora_expand(triton_ops.lora_shrink(x, w, info), w, out, info)
    delta = lora_delta(x, w, info)
    if info.row_index is None:
        out += delta
    else:
        out.index_add_(0, info.row_index, delta)
    return out


def lora_delta(x: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """`[LoRA rows, out]` in `x`'s dtype: each LoRA row's delta, in segment order (torch ops).

    The loop runs over the batch's adapters (at most max_loras_per_batch) and the projection's
    parts (at most 3), never over requests or rows."""
    xs = x if info.row_index is None else x.index_select(0, info.row_index)
    delta = x.new_zeros(info.num_lora_rows, sum(w.out_sizes))
    r = w.max_rank
    for slot, start, length in zip(info.seg_slots, info.seg_starts, info.seg_lens):
        if slot not in w.active:  # this adapter leaves the projection alone in this layer
            continue
        rows = slice(start, start + length)
        h = ((xs[rows] @ w.a[slot].T) * w.scaling[slot]).to(x.dtype)  # shrink, scaled per rank column
        for p, (first, size) in enumerate(zip(w.out_starts, w.out_sizes)):
            delta[rows, first : first + size] = h[:, p * r : (p + 1) * r] @ w.b[slot, first : first + size].T
    return delta
