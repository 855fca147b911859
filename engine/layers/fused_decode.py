"""Every decoder layer of a small forward as one C++ call (csrc/cpu_decode_layers.cpp).

Why: once the 4-bit GEMVs read the weights at the memory's speed, a bs-1 decode step of the
default model was ~5.3 ms of which ~1.7 ms was the Python between ~420 kernel calls (30 layers),
all on the one core a small forward has. The C++ loop calls the same kernels in the same order
with the same arguments, so its output is bit-identical to the Python layers (tests pin it), and
it releases the GIL for the whole step, so the event loop's thread (scheduling, detokenizing,
streaming) runs beside it instead of waiting between ops.

fp32 (the parity path, and `dtype auto` on a CPU without bf16 arithmetic): the loop runs the
torch ops the Python layers run between the projections (transformers' RMSNorm, rotary, SiLU, the
residual adds), called from C++, and each projection in the form its module picks for the row
count (the fp32 block loops of a GGUF's blocks, cpu_gemv's loop for a few dense rows, `F.linear`
above), so it is bit-identical to the Python layers too. Measured on a 2-core AVX2 CPU
(docs/PERFORMANCE.md): the Python-level calls of ~1,500 small ops were half of an fp32 decode step
of the default model.

When: `FusedDecodeLayers.build` decides once, after the KV pool exists, whether the model fits:
one rank, a CPU, Llama-style layers with SiLU (projection biases as Qwen2 has them and Qwen3's q/k
norm included; `model.llama_layers`: not Granite's residual multiplier nor OLMo 2's post-norms and
whole q/k norm; Phi-3 once its fused tensors are split, unless its rotary is partial, which has no
form here), a KV pool of the model's dtype, and either bf16 with the fused elementwise kernels and
every projection in our 4-bit or Q8_0 form (a GGUF's, or `--torchao-config`'s) and/or dense (VNNI
pairs, or prepacked for oneDNN), or fp32 with every projection dense and/or in our fp32-activation
block forms; a MoE layer's MLP (the router's torch ops, then, as `FusedMoE.forward`, its experts in blocks,
moe_quant.py, or its dense experts' one-call kernel, cpu_moe.cpp, in forwards within the kernel's
pairs bound: larger ones keep the Python layers).
A forward then takes it when its attention plan is the plain kernel decode or extend (a decode
step, a speculative verify, a prefill; cascade plans for shared prefixes keep the Python layers)
(any token count: above the quantized forms' row bound each projection runs its blocks'
dequantized tiles, or its dense weight where it has one, as QuantLinear does; at batch 32-128 the
Python between the ops still cost ~2-3 ms a step, docs/PERFORMANCE.md, ninth session).

Multi-LoRA: given the LoRA pool (CPU buffers in the model's dtype, the torch path's form), the loop holds every
(layer, projection) buffer by reference and a forward with adapter rows passes each token's slot
(`LoRABatchInfo.row_slots`): after each projection the C++ loop adds the deltas (csrc/cpu_lora.cpp,
engine/lora/ops.py's arithmetic and roundings, another summation order), instead of the forward
leaving the loop for the Python layers. An fp32 forward with adapter rows keeps the Python layers.

Deterministic inference: every projection is a `BatchInvariantLinear` over its VNNI or oneDNN
weight (or, fp32, its plain weight); the loop runs each on its block form at every row count where
it has one (`RowTiles.decode_blocks`), else decode's row tiles (`RowTiles.DECODE`, the same padded
calls; fp32: cpu_gemv's fixed-order loop in groups of its MAX_ROWS, as `gemv_groups`), so it takes
decode-like forwards (decode, verify) only, bit-identical to the Python layers there. A model whose
VNNI weights are its only forms takes every forward: their rows need no tiles.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from engine.cache.memory_pool import KVCache
from engine.kernels import cpu_extension, cpu_gemv
from engine.layers.activation import SiluAndMul
from engine.layers.attention_cpu import CpuAttnBackend, KernelDecodePlan, KernelExtendPlan
from engine.layers.attention_window import WindowedAttnBackend
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import (
    BatchInvariantLinear,
    DenseLinear,
    DequantTilesLinear,
    OneDNNLinear,
    QuantLinear,
    QuantParts,
    RowTiles,
    VnniLinear,
    native_blocks,
)
from engine.layers.moe import FusedMoE
from engine.layers.q8 import Q8Weight
from engine.lora.pool import LoRAPool
from engine.lora.projections import PROJECTIONS
from engine.model_executor.forward_batch_info import ForwardBatch


class _Form(NamedTuple):
    """A projection as the C++ loop takes it (csrc/decode_layers.h `Projection`)."""

    # the quantized form (4-bit tiles: codes, scales, offsets; Q8_0: int8 codes, scales) and/or
    # the dense weight (bf16: in VNNI pairs or oneDNN-packed; fp32: the plain weight)
    parts: list[torch.Tensor]
    out_features: int
    q4_rows: int | None  # the quantized form's row bound; None: no quantized form
    bias: torch.Tensor | None
    has_dense: bool  # the dense weight, which runs above the bound (or alone)
    # deterministic inference: the dense weight on row tiles of this size (fp32: gemv_f32 on
    # groups of this many rows)
    tile_rows: int = 0
    small_rows: int = 0  # an fp32 dense weight: 1..small_rows rows through gemv_f32 (DenseLinear)
    # QuantParts: each part's quantized tensors and output width (`parts` then holds the dense
    # weight, if any, only; the loop's `set_pieces`)
    pieces: tuple[tuple[list[torch.Tensor], int], ...] = ()
    tiles: bool = False  # no dense weight: above the bound the blocks' dequantized tiles run


def _fp32_dense(module: Any) -> bool:
    """Whether `module` is an fp32 CPU `DenseLinear` (its plain weight is the loop's dense form)."""
    return isinstance(module, DenseLinear) and module.weight.dtype == torch.float32 and module.weight.is_cpu


EVERY_ROW = 2**62  # a quantized form's row bound that no forward reaches


def _form(module: Any) -> _Form | None:
    """`module` as the loop runs it, or None (a form the loop has no kernel for)."""
    if isinstance(module, BatchInvariantLinear):
        # decode-like forwards only (`plan`): their tile, as `RowTiles.select` picks it, or (fp32)
        # the fixed-order loop's groups
        inner = module.inner
        if isinstance(inner, VnniLinear):  # each row's bits fixed at any row count: no tiles
            if module.blocks is not None and module.tiles.decode_blocks:
                # the blocks at every row count, in decode-like forwards only (an extend runs the
                # VNNI weight there): decode's tile size keeps the loop to those (`tiled`)
                blocks, pieces = native_blocks(module.blocks)
                parts = [*blocks, inner.packed]
                return _Form(parts, inner.out_features, EVERY_ROW, inner.bias, True, RowTiles.DECODE, pieces=pieces)
            return _Form([inner.packed], inner.out_features, None, inner.bias, True)
        if isinstance(inner, OneDNNLinear):
            if module.blocks is not None and module.tiles.decode_blocks:  # bf16 block loops, every row count
                blocks, pieces = native_blocks(module.blocks)
                parts = [*blocks, inner.packed]
                return _Form(parts, inner.out_features, EVERY_ROW, inner.bias, True, RowTiles.DECODE, pieces=pieces)
            return _Form([inner.packed], inner.out_features, None, inner.bias, True, RowTiles.DECODE)
        if _fp32_dense(inner) and module.tiles.decode_loop:
            if module.blocks is None:
                return _Form([inner.weight], inner.out_features, None, inner.bias, True, cpu_gemv.MAX_ROWS)
            # the block loops at every row count (no bound: `BatchInvariantLinear.blocks`)
            blocks, pieces = native_blocks(module.blocks)
            parts = [*blocks, inner.weight]
            return _Form(parts, inner.out_features, EVERY_ROW, inner.bias, True, cpu_gemv.MAX_ROWS, pieces=pieces)
        return None
    if isinstance(module, (OneDNNLinear, VnniLinear)):
        return _Form([module.packed], module.out_features, None, module.bias, True)
    if _fp32_dense(module):
        return _Form([module.weight], module.out_features, None, module.bias, True, small_rows=module.small_rows)
    if isinstance(module, QuantLinear) and isinstance(module.packed, (TiledQ4Weight, Q8Weight, QuantParts)):
        packed, big = module.packed, module.big
        parts, pieces = native_blocks(packed)
        small_rows = 0
        dense = isinstance(big, (OneDNNLinear, VnniLinear)) or _fp32_dense(big)
        if isinstance(big, (OneDNNLinear, VnniLinear)):
            parts.append(big.packed)
        elif dense:
            parts.append(big.weight)
            small_rows = big.small_rows
        # without a dense weight the loop runs the blocks' dequantized tiles above the bound
        tiles = isinstance(big, DequantTilesLinear)
        if not (dense or tiles):  # a form above the bound the loop has no kernel for
            return None
        bound = module.max_rows
        return _Form(
            parts, packed.out_features, bound, module.bias, dense, small_rows=small_rows, pieces=pieces, tiles=tiles
        )
    return None


def _elementwise_forms(model: Any, dtype: torch.dtype) -> bool:
    """Whether the loop computes `model`'s norms, rotary and activation as its layers do: bf16,
    the fused C++ ops (`model.fused`); fp32, their torch forms (full rotary: a partial one, as
    Phi-3's, has its own; the plain q/k norm, not Gemma 3's unit offset)."""
    if dtype == torch.bfloat16:  # the q/k norm too: the loop calls its kernel (plain weights only)
        norms = [layer.self_attn.qk_norm for layer in model.layers if layer.self_attn.qk_norm is not None]
        return model.fused and all(n.uses_cpu_kernel and not n.unit_offset for n in norms)
    if dtype != torch.float32 or len(model.rotaries) != 1:
        return False
    head_dim = model.cfg.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        if attn.rotary_emb.rotary_dim != head_dim or (attn.qk_norm is not None and attn.qk_norm.unit_offset):
            return False
    return True


class FusedDecodeLayers:
    """The C++ layer loop of one model over its KV pool; see the module docstring."""

    def __init__(self, native: Any, lora: bool = False, tiled: bool = False, max_tokens: int = EVERY_ROW) -> None:
        self.native = native  # every projection has a dense form or its blocks' tiles: any row count runs
        self.max_tokens = max_tokens  # a MoE model's dense experts: larger forwards keep the Python layers
        self.lora = lora  # it adds the LoRA pool's deltas: forwards with adapter rows may take it
        # deterministic inference: its projections run decode's row tiles, so it takes decode-like
        # forwards only (an extend's tiles are another size: its rows would differ by path)
        self.tiled = tiled

    @classmethod
    def build(cls, model: Any, pool: KVCache, lora: LoRAPool | None = None) -> FusedDecodeLayers | None:
        """The fused loop for `model` (a models.llama.LlamaForCausalLM: the type would import back
        up) over `pool`, with the multi-LoRA pool's buffers when `lora` is given, or None where it
        does not apply."""
        module = cpu_extension.load()
        cfg = model.cfg
        if module is None or not hasattr(module, "DecodeLayers") or model.tp.size != 1:
            return None
        if not model.llama_layers:  # a layer shape the loop does not implement (Granite, OLMo 2)
            return None
        dtype = model.embed_tokens.weight.dtype
        if pool.dtype != dtype or pool.device.type != "cpu" or not _elementwise_forms(model, dtype):
            return None
        layers = model.layers
        forms: list[list[_Form]] = []
        max_tokens = EVERY_ROW  # the forwards the loop may take (dense experts bound them)
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, FusedMoE):  # experts in blocks (moe_quant.py) or the dense one-call kernel
                projections = [_form(attn.qkv_proj), _form(attn.o_proj)]
                if (mlp.quant is None and mlp.kernel is None) or mlp.expert_start != 0:
                    return None
                if mlp.quant is None:  # FusedMoE.forward takes the kernel up to its pairs' bound only
                    max_tokens = min(max_tokens, mlp.kernel_max_pairs // mlp.top_k)
            else:
                projections = [_form(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
                if not isinstance(mlp.act_fn, SiluAndMul):
                    return None
            if None in projections:
                return None
            forms.append([f for f in projections if f is not None])
        # each projection keeps its module's row bound (a Q4_K_M file's Q4_K and Q6_K tensors
        # are measured apart, int4_crossover.py); the dense forms' tiling is one for the model
        tiles = {f.tile_rows for layer in forms for f in layer}
        small = {f.small_rows for layer in forms for f in layer if f.has_dense}
        if len(tiles) > 1 or len(small) > 1:
            return None
        tile_rows = tiles.pop()
        small_rows = small.pop() if small else 0
        native = module.DecodeLayers(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.softmax_scale)
        hidden = cfg.hidden_size
        for i, (layer, layer_forms) in enumerate(zip(layers, forms)):
            qk_norm = layer.self_attn.qk_norm
            moe = layer.mlp if isinstance(layer.mlp, FusedMoE) else None
            if moe is not None:  # no dense MLP: the experts come by set_moe
                none = _Form([], 2 * moe.intermediate_size, None, None, False)
                layer_forms = [*layer_forms, none, none._replace(out_features=hidden)]
            qkv, o, gate_up, down = layer_forms
            native.add_layer(
                layer.input_layernorm.weight,
                qkv.parts,
                qkv.out_features,
                o.parts,
                o.out_features,
                layer.post_attention_layernorm.weight,
                gate_up.parts,
                gate_up.out_features,
                down.parts,
                down.out_features,
                pool.k_buffer[i],
                pool.v_buffer[i],
                [f.q4_rows or 0 for f in (qkv, o, gate_up, down)],
                [qkv.bias, o.bias, gate_up.bias, down.bias],
                None if qk_norm is None else qk_norm.table,
                tile_rows,
                small_rows,
            )
            if moe is not None:
                experts = moe.quant.native if moe.quant is not None else None
                stacks = (None, None) if experts is not None else (moe.w13, moe.w2)
                options = (moe.top_k, moe.renormalize, moe.fp32_weights)
                native.set_moe(i, moe.gate, moe.router_packed, experts, *stacks, *options)
            for j, form in enumerate((qkv, o, gate_up, down)):
                if form.pieces:
                    tensors, widths = zip(*form.pieces)
                    native.set_pieces(i, j, list(tensors), list(widths), form.q4_rows)
        # without the pool's buffers in a form it runs, forwards with adapter rows keep the layers
        with_lora = lora is not None and _add_lora(native, lora)
        return cls(native, with_lora, tile_rows > 0, max_tokens)

    def plan(self, fb: ForwardBatch) -> KernelDecodePlan | KernelExtendPlan | None:
        """This forward's kernel attention plan when the fused loop takes the forward (the plain
        kernel decode or extend plan), else None."""
        if self.tiled and fb.forward_mode.is_extend() and not fb.forward_mode.is_verify():
            return None
        if fb.input_ids.shape[0] > self.max_tokens:
            return None
        backend = fb.attn_backend
        if isinstance(backend, WindowedAttnBackend):  # a sliding window past which a sequence ran
            if backend.own_layers:
                return None
            if backend.swa_inner is not None:  # hybrid SWA memory: the loop reads one slot table
                if not all(backend.windows):
                    return None
                backend = backend.swa_inner
            else:
                backend = backend.inner
        plan = backend.plan if isinstance(backend, CpuAttnBackend) else None
        return plan if isinstance(plan, (KernelDecodePlan, KernelExtendPlan)) else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fb: ForwardBatch,
        plan: KernelDecodePlan | KernelExtendPlan,
    ) -> torch.Tensor:
        """Every layer over the residual stream `x` (updated in place): the last layer's output."""
        rows = fb.lora.row_slots if fb.lora is not None and not fb.lora.empty else None
        loc = fb.out_cache_loc
        backend = fb.attn_backend
        if isinstance(backend, WindowedAttnBackend) and backend.swa_fb is not None:
            loc = backend.swa_fb.out_cache_loc  # every layer local (see `plan`): SWA slots
        if isinstance(plan, KernelDecodePlan):
            return self.native.forward(x, cos, sin, loc, plan.slots, plan.lens, None, plan.query_starts, rows)
        return self.native.forward(x, cos, sin, loc, plan.slots, plan.extend_lens, plan.prefix_lens, None, rows)


def _add_lora(native: Any, pool: LoRAPool) -> bool:
    """Hand the loop every (layer, projection) buffer of `pool` (kept by reference: slot writes
    land in place), where the pool computes with the same C++ kernel (`kernel` "cpu", the default
    on a CPU, bf16 or fp32), so a forward's deltas do not depend on which path
    took it; False elsewhere."""
    if pool.kernel != "cpu":
        return False
    for (layer, projection), w in pool.buffers.items():
        index = tuple(PROJECTIONS).index(projection)
        native.set_lora(layer, index, w.a_packed, w.bt_packed, w.scaling, list(w.out_sizes), w.max_rank)
    return True
