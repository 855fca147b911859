"""Native Llama-family decoder: Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm),
Granite (multipliers), OLMo 2 (post-norms, whole q/k RMSNorm), Phi-3 (fused checkpoint
tensors, partial rotary, longrope), Mistral (sliding window) and Gemma 2/3 (sandwich norms,
soft-caps, local/global layers, RoPE per layer type), Qwen3-MoE and Mixtral (mixture-of-experts
MLPs, engine/layers/moe.py: each expert's checkpoint tensors fill its rows of the stacked weights).

One implementation for all: what tells the families apart is in ModelConfig, and each switch
picks a module at construction (the decoder layer's shape: decoder_layers.py; the q/k norm:
layers/qk_norm.py; the rotary form: layers/rotary.py) or a checkpoint layout (checkpoint_parts.py).
Projections are fused (q|k|v in one matmul, gate|up in one) to cut per-layer kernel launches;
attention goes through the ForwardBatch's backend over the paged KV pool. Numerics follow
transformers' op order (RMSNorm in fp32, RoPE in fp32 then cast) so fp32 greedy output is
token-identical.

Every implementation choice is made before the first forward, never inside one:
- at construction, from the device and dtype: each norm, activation and rotary module picks the
  fused C++ op or the torch ops (engine/layers/norm.py, activation.py, rotary.py);
- after loading (`process_weights_after_loading`): each projection becomes its fastest form
  (engine/layers/linear.py: dense, oneDNN-prepacked, or int4 for small inputs) and the dense
  weights no form reads any more are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import VOCAB_PARALLEL, TPShard
from engine.errors import ModelLoadError
from engine.layers.fused_decode import FusedDecodeLayers
from engine.layers.int4 import Q4Blocks, TiledQ4Weight
from engine.layers.int4_crossover import blocks_beat_padded_tiles, measure_int4_crossover
from engine.layers.linear import (
    BatchInvariantLinear,
    DenseLinear,
    DequantTilesLinear,
    QuantLinear,
    QuantWeight,
    RowTiles,
    finalize_linear,
    pack_parts,
)
from engine.layers.moe import EXPERT_ROW_BOUND, FusedMoE
from engine.layers.moe_quant import EXPERT_PROJS
from engine.layers.norm import RMSNorm
from engine.layers.q8 import Q8Blocks
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_embedding import VocabEmbedding
from engine.layers.weight_quant import WeightOnlyQuant
from engine.model_config import QK_NORM_WHOLE, ModelConfig
from engine.model_executor.forward_batch_info import ForwardBatch
from engine.models.checkpoint_parts import WeightItem, llama_layout
from engine.models.decoder_layers import LlamaDecoderLayer, decoder_layer_class

# Hugging Face module inside a layer -> (our fused projection, part of it)
_PROJECTIONS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
# Hugging Face parameter inside a layer -> ours, for the unfused ones
_LAYER_PARAMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_feedforward_layernorm.weight",
    "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm.weight",
    "self_attn.q_norm.weight": "self_attn.qk_norm.q_weight",
    "self_attn.k_norm.weight": "self_attn.qk_norm.k_weight",
}
_GLOBAL_PARAMS = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}

PARAM, PART, SKIP, UNKNOWN = "param", "part", "skip", "unknown"
EXPERT = "expert"  # expert `part`'s projection `attr` of the FusedMoE at `path`
# a MoE layer's expert tensor (Mixtral's names are renamed to these by `llama_layout`)
_EXPERT_WEIGHT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class WeightTarget(NamedTuple):
    """Where one checkpoint tensor goes (`LlamaForCausalLM.weight_target`): a parameter by path
    (`PARAM`), or part `part` of the projection at `path`, its `attr` ("weight" | "bias") (`PART`)."""

    kind: str
    path: str = ""
    part: int = 0
    attr: str = ""


class LlamaForCausalLM(nn.Module):
    """The whole model at tp size 1; under tensor parallelism (`tp`), this rank's shard of it
    (engine/distributed/sharding.py): every layer ends in an all-reduce, the logits are gathered."""

    def __init__(
        self,
        cfg: ModelConfig,
        hf_config: PretrainedConfig,
        device: torch.device,
        dtype: torch.dtype,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp if tp is not None else TPGroup.single()
        self.shard = shard = TPShard.of(cfg, self.tp.rank, self.tp.size, self.tp.ep_size)
        rows = shard.vocab_rows
        self.embed_tokens = VocabEmbedding(
            rows, cfg.hidden_size, device, dtype, self.tp, shard.vocab_start, cfg.embedding_multiplier,
            cfg.embedding_scale_in_dtype,
        )  # fmt: skip
        # One RoPE for every layer, or (Gemma 3) one per layer type; `layer_rope[i]` picks layer i's.
        types = cfg.rope_layer_types or (None,) * cfg.num_layers
        kinds = list(dict.fromkeys(types))
        self.rotaries = [
            RotaryEmbedding(hf_config, cfg.head_dim, device, dtype, fp32_tables=cfg.rotary_fp32, layer_type=t)
            for t in kinds
        ]
        self.rotary_emb = self.rotaries[0]
        self.layer_rope = [kinds.index(t) for t in types]
        layer_class = decoder_layer_class(cfg)
        self.layers = nn.ModuleList(
            layer_class(cfg, i, self.rotaries[self.layer_rope[i]], self.tp, shard) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, device, dtype, cfg.norm_weight_before_cast, cfg.unit_offset_norms
        )
        tied = self.embed_tokens.weight if cfg.tie_word_embeddings else None
        self.lm_head = DenseLinear(cfg.hidden_size, (rows,), False, device, dtype, weight=tied)
        self.logits_scaling = cfg.logits_scaling  # Granite divides its logits by it
        self.final_logit_softcap = cfg.final_logit_softcap  # Gemma 2 squashes its logits through it
        # Whether the fused C++ layer loop implements these layers (csrc/cpu_decode_layers.cpp:
        # Llama's pre-norm layer, q/k/v biases, Qwen3's per-head q/k norm): not Granite's residual
        # multiplier, OLMo 2's post-norms or its whole q/k norm. The loop also needs every norm,
        # the activation and rotary in their fused forms (`fused`: not partial rotary, not OLMo 2's norms).
        # Nor a soft-capped attention; a sliding window only while no sequence passes it (`plan`).
        # A mixture-of-experts MLP only with its experts in blocks (FusedDecodeLayers.build checks).
        self.llama_layers = (
            layer_class is LlamaDecoderLayer and cfg.qk_norm != QK_NORM_WHOLE and cfg.attn_logit_softcap is None
        )
        # deterministic inference: the GEMM row count of this forward's mode (linear.py)
        self.row_tiles: RowTiles | None = None
        # set by the model runner once the KV pool exists, where the model fits (fused_decode.py)
        self.fused_decode: FusedDecodeLayers | None = None
        # Parameter paths (norms, embeddings, projection weights as built): a weight update
        # replaces projection modules, never the parameters `weight_target` maps names to.
        self._param_names = frozenset(n for n, _ in self.named_parameters())

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, V] (last new token of each request), or [num_tokens, V] with prompt logits;
        in the model's dtype on one rank, float32 gathered across ranks (`TPGroup.gather_vocab`).
        Under tensor parallelism only rank 0 gets them (None on the other ranks)."""
        if self.row_tiles is not None:
            self.row_tiles.select(not fb.forward_mode.is_extend() or fb.forward_mode.is_verify())
        x = self.embed_tokens(fb.input_ids)
        tables = [rotary.cos_sin(fb.positions) for rotary in self.rotaries]
        fused = self.fused_decode
        # a forward with adapter rows takes the fused loop where it was given the LoRA pool (nor a
        # sliding window: `plan` declines a forward with a sequence past it)
        plan = None
        if fused is not None and (fb.lora is None or fb.lora.empty or fused.lora):
            plan = fused.plan(fb)
        if fused is not None and plan is not None:  # a small decode: every layer in one C++ call
            x = fused.forward(x, *tables[0], fb, plan)
        else:
            for layer, rope in zip(self.layers, self.layer_rope):
                x = layer(x, *tables[rope], fb)
        if fb.prompt_logprob_rows is not None:  # scored by the runner, a slice at a time
            fb.prompt_hidden = x.index_select(0, fb.prompt_logprob_rows)
        if fb.embed_rows is not None:  # pooled by the scheduler into embeddings
            fb.embed_hidden = self.norm(x.index_select(0, fb.embed_rows)).float()
        if fb.forward_mode.is_prefill() and not fb.return_prompt_logits:  # verify keeps every row
            assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None
            x = x[fb.extend_start_loc + fb.extend_seq_lens - 1]
        return self.compute_logits(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits of final hidden states (pre-norm), as `forward` returns them. Under tensor
        parallelism a collective: every rank calls it with the same rows."""
        logits = self.lm_head(self.norm(hidden))
        if self.logits_scaling != 1.0:  # in the model's dtype, as transformers' Granite divides
            logits = logits / self.logits_scaling
        if self.final_logit_softcap is not None:  # in the model's dtype, as transformers' Gemma 2
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return self.tp.gather_vocab(logits, self.cfg.vocab_size)

    @property
    def fused(self) -> bool:
        """Whether every norm, the activation and rotary run the fused C++ ops (fixed at construction)."""
        return all(getattr(m, "uses_cpu_kernel", True) for m in self.modules())

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(
        self, weights: Iterable[WeightItem], quant: WeightOnlyQuant | None = None
    ) -> dict[str, QuantWeight]:
        """Copy Hugging Face-named tensors into the parameters; every parameter must be set.

        Each item may carry the weight's quantized blocks (`ModelSource.iter_weights_q4`); `quant`
        (`--torchao-config`) quantizes each decoder-layer projection part that came without, and
        the part then loads as its blocks dequantized (a MoE layer's experts too, which the layer
        keeps in blocks without a dense copy where it can run them so: moe_quant.py). Returns, by projection name,
        the quantized form of each projection whose every part came with blocks of one kind (one
        dense part, or a shape the kernel cannot take, leaves that projection dense only), and of
        the LM head when its weight (or the embedding it is tied to) came as Q8_0.
        """
        params = dict(self.named_parameters())
        seen: set[tuple[str, int]] = set()
        q4_parts: dict[str, dict[int, Q4Blocks | Q8Blocks | None]] = {}
        packed: dict[str, QuantWeight] = {}
        head_name = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        for name, tensor, blocks in llama_layout(weights, self.cfg, self.shard):
            if self.shard.zero_bias(name):
                tensor = torch.zeros_like(tensor)
            if name == head_name and isinstance(blocks, Q8Blocks) and self.tp.size == 1:
                form = blocks.pack(self.embed_tokens.weight.dtype)
                if form is not None and form.out_features == self.lm_head.out_features:
                    packed["lm_head"] = form
            target = self.weight_target(name)
            if target.kind == PARAM:
                self._copy(params[target.path], tensor, name)
                seen.add((target.path, 0))
            elif target.kind == EXPERT:
                moe = self.get_submodule(target.path)
                assert isinstance(moe, FusedMoE)
                if blocks is None and quant is not None and moe.takes_blocks and quant.applies_to(tensor):
                    blocks = quant.quantize(tensor)  # --torchao-config: experts the block kernels run
                    tensor = blocks.dequantize()
                if (shape := tuple(tensor.shape)) != moe.expert_shape(target.attr):
                    raise ModelLoadError(f"weight {name} has shape {shape}, expected {moe.expert_shape(target.attr)}")
                if not moe.keep_blocks(target.part, target.attr, blocks, tensor):  # kept: no dense copy
                    self._copy(moe.expert_weight(target.part, target.attr), tensor, name)
                seen.add((f"{target.path}.experts.{target.attr}", target.part))
            elif target.kind == PART:
                layer_weight = target.attr == "weight" and target.path != "lm_head"
                if layer_weight and blocks is None and quant is not None and quant.applies_to(tensor):
                    blocks = quant.quantize(tensor)
                    tensor = blocks.dequantize()
                self._load_part(target.path, target.attr, target.part, tensor, name)
                seen.add((f"{target.path}.{target.attr}", target.part))
                if layer_weight:
                    kept = blocks if isinstance(blocks, (Q4Blocks, Q8Blocks)) else None
                    self._collect_blocks(target.path, target.part, kept, q4_parts, packed)
        missing = sorted(self._expected_parts() - seen)
        if missing:
            raise ModelLoadError(f"weights missing from checkpoint: {[f'{n}[{s}]' for n, s in missing[:8]]}")
        return packed

    def weight_target(self, name: str) -> WeightTarget:
        """Where a Hugging Face-named tensor (after `llama_layout`) goes in this model: a
        parameter, a part of a (fused) projection, nothing (`SKIP`: a tied LM head, a rotary
        buffer), or `UNKNOWN` (a top-level name no architecture here has: loading ignores it, a
        weight update refuses it). A layer tensor this architecture lacks is a ModelLoadError."""
        if name in _GLOBAL_PARAMS:
            return WeightTarget(PARAM, _GLOBAL_PARAMS[name])
        if name == "lm_head.weight":
            return WeightTarget(SKIP) if self.cfg.tie_word_embeddings else WeightTarget(PART, "lm_head", 0, "weight")
        if not name.startswith("model.layers."):
            return WeightTarget(UNKNOWN)
        _, _, idx, rest = name.split(".", 3)
        module, _, kind = rest.rpartition(".")
        prefix = f"layers.{int(idx)}."
        if int(idx) < self.cfg.num_layers:
            if rest in _LAYER_PARAMS:
                param = prefix + _LAYER_PARAMS[rest]
                if param in self._param_names:
                    return WeightTarget(PARAM, param)
            elif module in _PROJECTIONS and kind in ("weight", "bias"):
                path, part = _PROJECTIONS[module]
                return WeightTarget(PART, prefix + path, part, kind)
            elif rest == "mlp.gate.weight" and prefix + "mlp.gate" in self._param_names:
                return WeightTarget(PARAM, prefix + "mlp.gate")  # a MoE layer's router
            elif (expert := _EXPERT_WEIGHT.fullmatch(rest)) and prefix + "mlp.w13" in self._param_names:
                if self.shard.holds_expert(int(expert[1])):
                    return WeightTarget(EXPERT, prefix + "mlp", int(expert[1]), expert[2])
                if int(expert[1]) < self.cfg.num_experts:
                    return WeightTarget(SKIP)  # another expert set's (expert parallelism)
            elif "rotary_emb" in rest:
                return WeightTarget(SKIP)
        raise ModelLoadError(f"unexpected weight {name} for {self.cfg.architecture}")

    def _load_part(self, path: str, kind: str, shard: int, tensor: torch.Tensor, name: str) -> None:
        linear = self.get_submodule(path)
        assert isinstance(linear, DenseLinear)
        target = getattr(linear, kind)
        if target is None:
            raise ModelLoadError(f"unexpected weight {name} for {self.cfg.architecture}")
        first, rows = linear.shard_rows(shard)
        self._copy(target.data[first : first + rows], tensor, name)

    def _collect_blocks(
        self,
        path: str,
        shard: int,
        blocks: Q4Blocks | Q8Blocks | None,
        parts: dict[str, dict[int, Q4Blocks | Q8Blocks | None]],
        packed: dict[str, QuantWeight],
    ) -> None:
        """Keep a part's blocks; once every part of `path` is in, fuse them (rows in order) and pack."""
        linear = self.get_submodule(path)
        assert isinstance(linear, DenseLinear)
        have = parts.setdefault(path, {})
        have[shard] = blocks
        if len(have) == len(linear.output_sizes):
            del parts[path]
            ordered = [have[s] for s in sorted(have)]
            if any(b is None for b in ordered):  # a part came dense: the projection stays dense
                return
            form = pack_parts(ordered, self.embed_tokens.weight.dtype)
            if form is not None:
                packed[path] = form

    def _expected_parts(self) -> set[tuple[str, int]]:
        """(parameter, part) pairs a complete checkpoint sets (a tied LM head is the embedding)."""
        parts: set[tuple[str, int]] = set()
        for module_name, module in self.named_modules():
            if module_name == "lm_head" and self.cfg.tie_word_embeddings:
                continue
            if isinstance(module, FusedMoE):  # the router, and each expert's three projections
                parts.add((f"{module_name}.gate", 0))
                local = range(module.expert_start, module.expert_start + module.num_local_experts)
                parts |= {(f"{module_name}.experts.{p}", e) for p in EXPERT_PROJS for e in local}
                continue
            n = len(module.output_sizes) if isinstance(module, DenseLinear) else 1
            for kind, _ in module.named_parameters(recurse=False):
                parts |= {(f"{module_name}.{kind}", s) for s in range(n)}
        return parts

    def _copy(self, target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if name in VOCAB_PARALLEL and tensor.shape[0] < target.shape[0]:
            # the last vocabulary shard: the real rows, then zero rows (looked up by no token;
            # their logits are cut off after the gather)
            target.data[tensor.shape[0] :].zero_()
            target = target.data[: tensor.shape[0]]
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.data.copy_(tensor)

    def process_weights_after_loading(
        self, q4: dict[str, QuantWeight], q4_max_rows: int | None, batch_invariant: bool = False
    ) -> int:
        """Give every projection its final form (linear.finalize_linear); returns the row bound
        of the quantized path: `q4_max_rows`, or when None measured here on the model's own
        projections (int4_crossover.py; the 4-bit layers and the Q8_0 LM head apart, as their
        kernels differ; the layers' bound is returned); 0 = off, and then no quantized form is kept.

        Projections are replaced one at a time, so each dense weight is freed as soon as its
        oneDNN or quantized form exists (a tied LM head keeps the embedding table, which the lookup
        still reads). `batch_invariant` (deterministic inference): every projection, the LM head
        included, runs its dense form in fixed row tiles and no quantized form is kept (returns 0).
        A MoE layer runs its experts in blocks (moe_quant.py) unless the quantized path is off.
        """
        rows = self._finalize_projections(q4, q4_max_rows, batch_invariant)
        quantized = q4_max_rows != 0 and not batch_invariant
        for module in self.modules():
            if isinstance(module, FusedMoE):  # the experts' bound: the layers' crossover where one was found
                module.finish_loading(quantized, rows if rows > 0 else EXPERT_ROW_BOUND)
        return rows

    def _finalize_projections(self, q4: dict[str, QuantWeight], q4_max_rows: int | None, batch_invariant: bool) -> int:
        for layer in self.layers:
            if layer.self_attn.qk_norm is not None:
                layer.self_attn.qk_norm.process_weights_after_loading()
        measure = q4_max_rows is None and not batch_invariant
        rows = 0 if batch_invariant else 1 if q4_max_rows is None else q4_max_rows  # 1: provisional while measuring
        weight = self.embed_tokens.weight
        self.row_tiles = RowTiles.for_weights(weight.dtype, weight.device) if batch_invariant else None
        names = [name for name, module in self.named_modules() if isinstance(module, DenseLinear)]
        for name in names:
            dense = self.get_submodule(name)
            assert isinstance(dense, DenseLinear)
            shared = dense.weight is weight  # a tied head: the embedding table stays resident anyway
            self.set_submodule(name, finalize_linear(dense, q4.get(name), rows, self.row_tiles, shared))
        tiles = self.row_tiles
        if tiles is not None and tiles.decode_blocks and weight.dtype == torch.bfloat16:
            # bf16's alternative to the blocks is the padded tile (fp32's, a fixed-order loop that
            # reads more bytes than the blocks, always loses): measured, as AMX runs tiles fast
            blocks = [m for m in self.modules() if isinstance(m, BatchInvariantLinear) and m.blocks is not None]
            tiles.decode_blocks = bool(blocks) and blocks_beat_padded_tiles(blocks, weight.dtype)
            if not tiles.decode_blocks:
                for m in blocks:
                    m.blocks = None  # no forward reads them
        if not measure:
            return rows
        quant = [(name, m) for name, m in self.named_modules() if isinstance(m, QuantLinear)]
        # different kernels, measured apart: the 4-bit layers, the 8-bit ones (a Q4_K_M file's
        # Q6_K tensors), the LM head
        layers = [(name, m) for name, m in quant if name != "lm_head" and isinstance(m.packed, TiledQ4Weight)]
        layers8 = [(name, m) for name, m in quant if name != "lm_head" and not isinstance(m.packed, TiledQ4Weight)]
        head = [(name, m) for name, m in quant if name == "lm_head"]
        dtype = weight.dtype  # the inputs' (fp32 and bf16 run different loops)
        groups = (layers, layers8, head)
        bounds = [measure_int4_crossover([m for _, m in group], dtype) if group else 0 for group in groups]
        rows = min((b for b, group in zip(bounds[:2], groups[:2]) if group), default=0)  # the experts' bound too
        for group, bound in zip(groups, bounds):
            for name, m in group:
                if bound > 0 or isinstance(m.big, DequantTilesLinear):
                    m.max_rows = bound  # 0: the blocks' tiles at every row count
                else:  # the quantized kernel never wins here: keep only the dense form
                    self.set_submodule(name, m.big)
        return rows


# Every supported architecture runs as LlamaForCausalLM (its ModelConfig switches pick the parts).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Olmo2ForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
}
