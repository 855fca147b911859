"""Mixture-of-experts MLP (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, Mixtral's `MixtralSparseMoeBlock`):
a router picks `top_k` of `num_experts` gated MLPs per token and sums their outputs, weighted.

`FusedMoE` (SGLang's name) holds every expert's weights stacked, in the model dtype: `w13`
`[E, 2I, H]` (gate rows, then up rows: one GEMM per expert, as `LlamaMLP`'s fused gate|up) and
`w2` `[E, H, I]`, plus the router's `gate` `[E, H]`. An fp32 model loaded from a GGUF whose experts
are Q4_0/Q4_1 (or quantized by `--torchao-config int4wo-*`) also keeps them in those 4-bit blocks
(moe_q4.py) for forwards of up to `Q4_MAX_GROUP` pairs an expert; there is no oneDNN-prepacked form
of the experts.

Routing follows transformers' op order exactly (fp32 greedy tokens are compared token for token):
router logits in the model dtype -> softmax in fp32 -> top-k -> divided by their sum when
`renormalize` (Qwen3-MoE's `norm_topk_prob`; Mixtral always) -> cast to the model dtype
(Qwen3-MoE), or kept fp32 so each expert's output is scaled in fp32 and then cast (Mixtral:
`fp32_weights`). The experts run grouped: the (token, choice) pairs are sorted by expert id, so
each expert with tokens runs its gate|up GEMM, the activation and its down GEMM once, over its
contiguous group; the scaled outputs are `index_add_`-ed into the result in ascending expert
order (transformers' summation order).

Under tensor parallelism each rank holds its slice of every expert's intermediate columns (its
rows of gate and of up, its columns of down): its output is a partial sum, all-reduced as
`LlamaMLP`'s. With expert parallelism (`--ep-size`) a rank holds only its set's experts
(`expert_start`, `num_local_experts`; engine/distributed/sharding.py), sliced over the set, and
runs only the (token, choice) pairs routed to them: the all-reduce sums the sets' outputs. The
router is replicated, so every rank routes every token alike. The per-expert loop reads the
group sizes on the host: no CUDA graph can capture it. On CUDA the experts run as two grouped
Triton GEMMs instead (triton_moe.py: no host read; pairs summed per token in a fixed order). On a
CPU (bf16 or fp32), a forward whose mean expert group is small (`KERNEL_MAX_GROUP`: decode steps,
short prefills) runs every expert in one C++ call (engine/kernels/csrc/cpu_moe.cpp: the same
roundings and summation order over experts, no op per expert; only each dot product's internal
order differs from the GEMM library's, and fp32 greedy tokens stay transformers', tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.kernels import cpu_extension
from engine.layers.activation import get_act_and_mul
from engine.layers.int4 import Q4Blocks
from engine.layers.moe_q4 import Q4Experts

# A CPU forward runs the experts in one C++ call (cpu_moe.cpp) while the mean expert group is at
# most this many (token, expert) pairs; larger groups go faster through the library GEMMs. Measured
# crossovers (docs/PERFORMANCE.md), 8 and 64 experts: bf16 against oneDNN at 8-10 pairs; fp32
# against MKL's sgemm at 16-64 (the kernel's fp32 rows need no widening, and sgemm runs at a lower
# rate than the AMX/AVX512-BF16 GEMMs).
KERNEL_MAX_GROUP = {torch.bfloat16: 8, torch.float32: 24}
# An fp32 forward runs the experts' 4-bit blocks (moe_q4.py), when it has them, while the mean
# expert group is at most this many pairs: they beat the fp32 kernel at every group size measured
# and the grouped sgemm path up to 32-64 pairs (docs/PERFORMANCE.md).
Q4_MAX_GROUP = 32


class FusedMoE(nn.Module):
    """This rank's slice of every expert (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,  # this rank's columns of each expert
        hidden_act: str,
        renormalize: bool,
        fp32_weights: bool,
        tp: TPGroup,
        device: torch.device,
        dtype: torch.dtype,
        expert_start: int = 0,  # this rank's experts (expert parallelism): [start, start + local)
        num_local_experts: int | None = None,  # None: all of them
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.intermediate_size = num_experts, top_k, intermediate_size
        self.expert_start = expert_start
        self.num_local_experts = local = num_experts if num_local_experts is None else num_local_experts
        self.renormalize, self.fp32_weights = renormalize, fp32_weights
        self.tp = tp

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)

        self.gate = param(num_experts, hidden_size)
        self.w13 = param(local, 2 * intermediate_size, hidden_size)
        self.w2 = param(local, hidden_size, intermediate_size)
        self.act_fn = get_act_and_mul(hidden_act, intermediate_size, device, dtype)
        # on a CPU, forwards of a few tokens run every expert in one C++ call (cpu_moe.cpp)
        module = cpu_extension.load() if device.type == "cpu" and dtype in KERNEL_MAX_GROUP else None
        self.kernel = module if hidden_act == "silu" and hasattr(module, "moe_experts") else None
        self.kernel_max_pairs = KERNEL_MAX_GROUP.get(dtype, 0) * num_experts
        # the 4-bit experts, filled while loading (`keep_blocks`) and kept by `finish_loading`
        four_bit = dtype == torch.float32 and hasattr(self.kernel, "moe_experts_q4") and Q4Experts.available()
        self._q4_loading = Q4Experts(expert_start, local, intermediate_size) if four_bit else None
        self.q4: Q4Experts | None = None
        self.q4_max_pairs = Q4_MAX_GROUP * num_experts

    def holds(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def expert_weight(self, expert: int, proj: str) -> torch.Tensor:
        """The part of `w13`/`w2` that checkpoint tensor `experts.<expert>.<proj>.weight` fills
        (a view; `expert` one this rank holds; `proj` is `gate_proj`, `up_proj` or `down_proj`)."""
        assert self.holds(expert), f"expert {expert} is not on this rank"
        expert -= self.expert_start
        i = self.intermediate_size
        if proj == "gate_proj":
            return self.w13.data[expert, :i]
        if proj == "up_proj":
            return self.w13.data[expert, i:]
        return self.w2.data[expert]

    @property
    def takes_blocks(self) -> bool:
        """Whether this layer (still loading) would run its experts' 4-bit blocks."""
        return self._q4_loading is not None

    def keep_blocks(self, expert: int, proj: str, blocks: object, tensor: torch.Tensor) -> None:
        """A loaded expert projection's 4-bit blocks (its exact values), when it came with them
        whole (a tensor-parallel slice has none); anything else leaves the layer dense only."""
        if self._q4_loading is not None:
            whole = isinstance(blocks, Q4Blocks) and tuple(blocks.q.shape) == tuple(tensor.shape)
            self._q4_loading.add(expert, proj, blocks if whole else None)

    def finish_loading(self, quantized: bool) -> None:
        """Keep the 4-bit experts if every expert came with blocks and `quantized` (the model's
        4-bit path is on)."""
        loading, self._q4_loading = self._q4_loading, None
        if loading is not None and loading.finish() and quantized:
            self.q4 = loading

    def drop_quantized(self) -> None:
        """New dense values were copied in (a weight update): the 4-bit form is stale."""
        self.q4 = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights and expert ids, `[T, top_k]` each (transformers' router)."""
        logits = F.linear(x, self.gate)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.fp32_weights else weights.to(logits.dtype)), ids

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's chosen experts (this rank's) of `weight * expert(x)`, tokens
        grouped by expert."""
        flat = ids.flatten() - self.expert_start
        if self.num_local_experts < self.num_experts:  # expert parallelism: this rank's pairs only
            pairs = ((flat >= 0) & (flat < self.num_local_experts)).nonzero().squeeze(1)
            flat = flat[pairs]
            order = pairs[torch.argsort(flat, stable=True)]  # (token, choice) pairs, grouped by expert
        else:
            order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_local_experts).tolist()
        tokens = order // self.top_k
        scale = weights.flatten()[order, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = self.act_fn(F.linear(x[rows], self.w13[expert]))
            y = F.linear(h, self.w2[expert]) * scale[start : start + n]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out

    def forward(self, x: torch.Tensor, fb: object = None) -> torch.Tensor:
        """`fb` is the ForwardBatch `LlamaMLP` takes; unused (LoRA on MoE models is refused)."""
        weights, ids = self.route(x)
        if x.is_cuda:
            from engine.layers.triton_moe import fused_experts  # a CPU model never imports triton

            return self.tp.all_reduce(fused_experts(x, self.w13, self.w2, weights, ids, self.act_fn, self.expert_start))
        pairs = x.shape[0] * self.top_k
        if self.q4 is not None and pairs <= self.q4_max_pairs:
            return self.tp.all_reduce(self.q4.run(self.kernel, x, ids - self.expert_start, weights.float()))
        if self.kernel is not None and pairs <= self.kernel_max_pairs:
            out = self.kernel.moe_experts(x, self.w13, self.w2, ids - self.expert_start, weights.float())
            return self.tp.all_reduce(out)
        return self.tp.all_reduce(self.experts(x, weights, ids))

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
