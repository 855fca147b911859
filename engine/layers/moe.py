"""Mixture-of-experts MLP (Qwen3-MoE's `Qwen3MoeSparseMoeBlock`, Mixtral's `MixtralSparseMoeBlock`):
a router picks `top_k` of `num_experts` gated MLPs per token and sums their outputs, weighted.

`FusedMoE` (SGLang's name) holds every expert's weights stacked, in the model dtype: `w13`
`[E, 2I, H]` (gate rows, then up rows: one GEMM per expert, as `LlamaMLP`'s fused gate|up) and
`w2` `[E, H, I]`, plus the router's `gate` `[E, H]`. A CPU model loaded from a GGUF (or quantized by
`--torchao-config`) whose experts came in blocks a kernel form takes keeps them in those blocks
only (moe_quant.py: every forward runs them, the dense stacks are dropped) until a weight update
gives it dense values again; there is no oneDNN-prepacked form of the experts.

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
from engine.layers.linear import onednn_bf16_available
from engine.layers.moe_quant import QuantExperts
from engine.layers.q8 import Q8Blocks

# A CPU forward runs the experts in one C++ call (cpu_moe.cpp) while the mean expert group is at
# most this many (token, expert) pairs; larger groups go faster through a GEMM per expert. Measured
# crossovers (docs/PERFORMANCE.md): bf16 against the experts' repacked tiles (`expert_linear`) at
# ~30 pairs (128 experts, AVX512-BF16 without AMX; against oneDNN's F.linear it was 8-10 before the
# kernel's jobs went in expert order); fp32 against MKL's sgemm at 16-64 (the kernel's fp32 rows
# need no widening, and sgemm runs at a lower rate than the AMX/AVX512-BF16 GEMMs).
KERNEL_MAX_GROUP = {torch.bfloat16: 24, torch.float32: 24}
# Rows per expert above which the quantized experts run their dequantized tiles, where the model
# has no quantized dense projection whose crossover was measured (int4_crossover.py)
EXPERT_ROW_BOUND = 16


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
        # larger bf16 groups: each expert's two products through tiles repacked for our dot-product
        # kernel (cpu_quant_tiles.cpp), as F.linear on a stacked expert's unpacked weight reorders
        # the whole weight for oneDNN on every call
        tiles = dtype == torch.bfloat16 and module is not None and hasattr(module, "bf16_tiles_mm")
        self.expert_linear = module.bf16_tiles_mm if tiles else F.linear
        # the experts in blocks, filled while loading (`keep_blocks`) and kept by `finish_loading`
        blocks = device.type == "cpu" and hidden_act == "silu" and QuantExperts.available(dtype)
        quant = QuantExperts(expert_start, local, hidden_size, intermediate_size, dtype) if blocks else None
        self._quant_loading = quant
        self.quant: QuantExperts | None = None
        # bf16 on a CPU: the router's weight also prepacked for oneDNN (`pack_router`), as F.linear
        # reorders it on every call: a decode row's product took 2.3x as long, for the same bits
        self.router_packed: torch.Tensor | None = None
        self._pack_router = device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16_available()
        # with it, the C++ router (cpu_moe_router.cpp: a few rows through its own loop, more
        # through the prepacked form), which the fused decode loop calls too
        self._router_logits = getattr(module, "moe_router_logits", None)

    @property
    def in_features(self) -> int:
        return self.gate.shape[1]

    @property
    def out_features(self) -> int:  # with `in_features`, the shape linear.one_row_pass keys a MoE layer by
        return self.num_local_experts

    def holds(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def expert_shape(self, proj: str) -> tuple[int, int]:
        """The shape of checkpoint tensor `experts.<e>.<proj>.weight` on this rank."""
        hidden = self.in_features
        return (self.intermediate_size, hidden) if proj != "down_proj" else (hidden, self.intermediate_size)

    def expert_weight(self, expert: int, proj: str) -> torch.Tensor:
        """The part of `w13`/`w2` that checkpoint tensor `experts.<expert>.<proj>.weight` fills
        (a view; `expert` one this rank holds; `proj` is `gate_proj`, `up_proj` or `down_proj`)."""
        assert self.holds(expert), f"expert {expert} is not on this rank"
        assert self.quant is None, "the experts are in blocks: drop_quantized() first"
        expert -= self.expert_start
        i = self.intermediate_size
        if proj == "gate_proj":
            return self.w13.data[expert, :i]
        if proj == "up_proj":
            return self.w13.data[expert, i:]
        return self.w2.data[expert]

    @property
    def takes_blocks(self) -> bool:
        """Whether this layer (still loading) would run its experts' blocks."""
        return self._quant_loading is not None

    def keep_blocks(self, expert: int, proj: str, blocks: object, tensor: torch.Tensor) -> bool:
        """Keep a loaded expert projection's blocks (its exact values) when it came with them whole
        (a tensor-parallel slice has none) and the layer can still run its experts in blocks: True,
        and the loader skips the dense copy. Otherwise the layer goes dense (the values kept so far
        written into the stacks) and the loader copies `tensor`."""
        loading = self._quant_loading
        if loading is None:
            return False
        whole = isinstance(blocks, (Q4Blocks, Q8Blocks)) and tuple(blocks.q.shape) == tuple(tensor.shape)
        if whole and loading.add(expert, proj, blocks):
            return True
        self._quant_loading = None
        self._write_dense(loading)
        return False

    def _write_dense(self, loading: QuantExperts) -> None:
        for expert, proj, values in loading.held():
            if proj == "gate_up":
                self.w13.data[expert - self.expert_start].copy_(values)
            elif proj == "down":
                self.w2.data[expert - self.expert_start].copy_(values)
            else:
                self.expert_weight(expert, proj).copy_(values)

    def finish_loading(self, quantized: bool, row_bound: int = EXPERT_ROW_BOUND) -> None:
        """Run the experts in blocks only if every expert came with blocks and `quantized` (the
        model's quantized path is on): the dense stacks (never written) are freed; otherwise they
        get the blocks' values. `row_bound`: the model's measured crossover from the block loops
        to the dequantized tiles."""
        self.pack_router()
        loading, self._quant_loading = self._quant_loading, None
        if loading is None:
            return
        if quantized and loading.finish(row_bound):
            self.quant = loading
            for p in (self.w13, self.w2):
                p.data = p.data.new_empty(0)
        else:
            self._write_dense(loading)

    def drop_quantized(self) -> None:
        """Go back to dense experts (the blocks' values), so new dense values can be copied in (a
        weight update): the blocks would be stale."""
        if self.quant is not None:
            self.w13.data, self.w2.data = self.quant.dense(self.w13.dtype)
            self.quant = None

    def pack_router(self) -> None:
        """(Re)build the router's prepacked form from `gate`: after loading, after a weight update."""
        if self._pack_router:
            self.router_packed = torch.ops.mkldnn._reorder_linear_weight(self.gate.detach().contiguous(), 1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights and expert ids, `[T, top_k]` each (transformers' router)."""
        if self.router_packed is None:
            logits = F.linear(x, self.gate)
        elif self._router_logits is not None:
            logits = self._router_logits(x, self.gate, self.router_packed)
        else:
            logits = torch.ops.mkldnn._linear_pointwise(x, self.router_packed, None, "none", [None], "")
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
            h = self.act_fn(self.expert_linear(x[rows], self.w13[expert]))
            y = self.expert_linear(h, self.w2[expert]) * scale[start : start + n]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out

    def forward(self, x: torch.Tensor, fb: object = None) -> torch.Tensor:
        """`fb` is the ForwardBatch `LlamaMLP` takes; unused (LoRA on MoE models is refused)."""
        weights, ids = self.route(x)
        if x.is_cuda:
            from engine.layers.triton_moe import fused_experts  # a CPU model never imports triton

            return self.tp.all_reduce(fused_experts(x, self.w13, self.w2, weights, ids, self.act_fn, self.expert_start))
        if self.quant is not None:
            return self.tp.all_reduce(self.quant.run(x, ids - self.expert_start, weights.float()))
        pairs = x.shape[0] * self.top_k
        if self.kernel is not None and pairs <= self.kernel_max_pairs:
            out = self.kernel.moe_experts(x, self.w13, self.w2, ids - self.expert_start, weights.float())
            return self.tp.all_reduce(out)
        return self.tp.all_reduce(self.experts(x, weights, ids))

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)
