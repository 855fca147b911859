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

Three implementations, chosen when the pool is built (`LoRAPool.kernel`): the C++ loops of
csrc/cpu_lora.cpp (bf16 and fp32 on a CPU: one call per projection, in bf16 the same code the
fused layer loop runs), torch ops (the reference, and a CPU without the built extension; per
adapter one shrink and one expand over the block-diagonal B, added into the output in place; a
gather and a scatter-add around them when base rows are mixed in), and the Triton SGMV kernels
(triton_ops.py; GPU), imported only when used so CPU-only code never needs triton.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_extension
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
    if info.pool.kernel == "cpu":  # csrc/cpu_lora.cpp (in bf16 as the fused layer loop runs it)
        native = cpu_extension.module_or_raise()
        sizes = list(w.out_sizes)
        return native.lora_add_(x, out, w.a_packed, w.bt_packed, w.scaling, sizes, w.max_rank, info.row_slots)
    if info.pool.kernel == "triton":
        from engine.lora import triton_ops  # the GPU path only: see the module docstring

        return triton_ops.lora_expand(triton_ops.lora_shrink(x, w, info), w, out, info)
    if len(info.seg_slots) > 1:
        return add_padded_lora_deltas(x, out, w, info)
    if info.row_index is None:  # every row is a LoRA row, in segment order: add in place
        return add_lora_deltas(x, out, w, info)
    delta = add_lora_deltas(x.index_select(0, info.row_index), x.new_zeros(info.num_lora_rows, out.shape[1]), w, info)
    return out.index_add_(0, info.row_index, delta)


def add_lora_deltas(xs: torch.Tensor, target: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """Add each LoRA row's delta to `target` (`[LoRA rows, out]`, segment order) in place (torch
    ops): per adapter, `target[rows] += ((xs[rows] @ A.T) * scaling) @ Bt`. The loop runs over the
    batch's adapters (at most max_loras_per_batch), never over requests or rows."""
    assert w.bt is not None, "the torch path's block-diagonal B (LoRAPool kernel 'torch')"
    for slot, start, length in zip(info.seg_slots, info.seg_starts, info.seg_lens):
        if slot not in w.active:  # this adapter leaves the projection alone in this layer
            continue
        rows = slice(start, start + length)
        h = ((xs[rows] @ w.a[slot].T) * w.scaling[slot]).to(xs.dtype)  # shrink, scaled per rank column
        target[rows].addmm_(h, w.bt[slot])
    return target


def add_padded_lora_deltas(x: torch.Tensor, out: torch.Tensor, w: LoRAWeights, info: LoRABatchInfo) -> torch.Tensor:
    """Several adapters at once (torch ops): the segments padded to the longest (`info.padded`),
    one batched shrink and one batched expand over the segments' slots, the LoRA rows' deltas
    added to `out`. A fixed number of ops whatever the number of adapters (one op per adapter per
    projection was most of a LoRA decode step on a CPU); a slot that leaves this projection alone
    holds zeros, so it adds zeros."""
    assert w.bt is not None, "the torch path's block-diagonal B (LoRAPool kernel 'torch')"
    slots, rows, valid, length = info.padded
    xs = x.index_select(0, rows).view(slots.numel(), length, x.shape[1])
    h = torch.bmm(xs, w.a.index_select(0, slots).transpose(1, 2))
    h = (h * w.scaling.index_select(0, slots)[:, None, :]).to(x.dtype)  # shrink, scaled per rank column
    delta = torch.bmm(h, w.bt.index_select(0, slots)).view(-1, out.shape[1]).index_select(0, valid)
    if info.row_index is None:
        return out.add_(delta)
    return out.index_add_(0, info.row_index, delta)
