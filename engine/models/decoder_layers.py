"""The decoder layers of the Llama family, one class per layer shape (chosen at construction by
`decoder_layer_class`, so no forward tests a feature flag):

- `LlamaDecoderLayer`: pre-norm, `x + attn(norm(x))`, `x + mlp(norm(x))`. Llama, Qwen2 (q/k/v
  biases), Qwen3 (per-head q/k norm) and Phi-3 (its fused checkpoint tensors are split at load;
  partial rotary is the rotary module's business);
- `GraniteDecoderLayer`: the same with each sublayer's output scaled by `residual_multiplier`
  before the residual add;
- `Olmo2DecoderLayer`: no pre-norm; each sublayer's output is normalised (`post_attention_layernorm`,
  `post_feedforward_layernorm`) before the residual add; its attention normalises the whole q and k.
- `SandwichDecoderLayer` (Gemma 2/3): a norm before and after each sublayer, all four scaling by
  `1 + weight` (`x + post_norm(attn(norm(x)))`, then `x + post_ff_norm(mlp(pre_ff_norm(x)))`).

Attention and MLP are shared: q|k|v and gate|up are each one fused projection (fewer kernel
launches), attention goes through the ForwardBatch's backend over the paged KV pool. A forward
with LoRA rows (`fb.lora`, engine/lora/) adds each adapter's delta to the four projections'
outputs in place, before the row-parallel all-reduce; without, the code run is unchanged.
A mixture-of-experts layer (Qwen3-MoE, Mixtral: `cfg.moe_layers`) has `FusedMoE` (engine/layers/moe.py)
as its MLP instead of `LlamaMLP`, chosen per layer by `make_mlp`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TPGroup
from engine.distributed.sharding import TPShard
from engine.kernels import cpu_elementwise
from engine.layers.activation import get_act_and_mul
from engine.layers.linear import DenseLinear
from engine.layers.moe import FusedMoE
from engine.layers.norm import AddRMSNorm, RMSNorm
from engine.layers.qk_norm import QKNorm, WholeQKNorm
from engine.layers.rotary import RotaryEmbedding
from engine.lora.ops import apply_lora
from engine.model_config import QK_NORM_HEAD, QK_NORM_WHOLE, ModelConfig
from engine.model_executor.forward_batch_info import ForwardBatch


class LlamaAttention(nn.Module):
    """This rank's heads (all of them at tp size 1): q|k|v column-parallel, o row-parallel."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TPGroup, shard: TPShard):
        super().__init__()
        device, dtype = rotary_emb.device, rotary_emb.dtype
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
        sizes = (self.q_size, self.kv_size, self.kv_size)
        self.qkv_proj = DenseLinear(cfg.hidden_size, sizes, cfg.attention_bias, device, dtype)
        self.o_proj = DenseLinear(self.q_size, (cfg.hidden_size,), cfg.o_bias, device, dtype)
        self.qk_norm: QKNorm | WholeQKNorm | None = None
        if cfg.qk_norm == QK_NORM_HEAD:
            self.qk_norm = QKNorm(cfg.head_dim, cfg.rms_norm_eps, shard, device, dtype, cfg.unit_offset_norms)
        elif cfg.qk_norm == QK_NORM_WHOLE:
            self.qk_norm = WholeQKNorm(cfg.head_dim, cfg.rms_norm_eps, tp, shard, device, dtype)
        self.rotary_emb = rotary_emb

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if fb.lora is not None:
            apply_lora(x, qkv, self.layer_id, "qkv_proj", fb.lora)
        # q and k are adjacent in qkv: normalise and rotate them as one [t, H + KVH, D] slab
        # (half the per-layer elementwise ops of doing each; same per-element arithmetic).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = self.qk_norm(qk)
        qk = self.rotary_emb(qk, cos, sin)
        attn = fb.attn_backend.forward(qk[:, : self.num_heads], qk[:, self.num_heads :], v, self.layer_id, fb)
        if fb.lora is None:
            return self.tp.all_reduce(self.o_proj(attn))
        out = self.o_proj(attn)
        apply_lora(attn, out, self.layer_id, "o_proj", fb.lora)
        return self.tp.all_reduce(out)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class LlamaMLP(nn.Module):
    """This rank's MLP columns: gate|up column-parallel, down row-parallel."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, tp: TPGroup, shard: TPShard, device: torch.device, dtype: torch.dtype
    ):
        super().__init__()
        self.layer_id = layer_id  # the LoRA pool's buffers are per layer
        self.tp = tp
        inter = shard.intermediate_size
        self.gate_up_proj = DenseLinear(cfg.hidden_size, (inter, inter), cfg.mlp_bias, device, dtype)
        self.down_proj = DenseLinear(inter, (cfg.hidden_size,), cfg.mlp_bias, device, dtype)
        self.act_fn = get_act_and_mul(cfg.hidden_act, inter, device, dtype)

    def forward(self, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if fb.lora is None:
            return self.tp.all_reduce(self.down_proj(self.act_fn(self.gate_up_proj(x))))
        gate_up = apply_lora(x, self.gate_up_proj(x), self.layer_id, "gate_up_proj", fb.lora)
        h = self.act_fn(gate_up)
        return self.tp.all_reduce(apply_lora(h, self.down_proj(h), self.layer_id, "down_proj", fb.lora))

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


def make_mlp(
    cfg: ModelConfig, layer_id: int, tp: TPGroup, shard: TPShard, device: torch.device, dtype: torch.dtype
) -> LlamaMLP | FusedMoE:
    """Layer `layer_id`'s MLP: the experts on a sparse layer of a MoE model, else the dense one."""
    if layer_id not in cfg.moe_layers:
        return LlamaMLP(cfg, layer_id, tp, shard, device, dtype)
    return FusedMoE(
        cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, shard.moe_intermediate_size, cfg.hidden_act,
        cfg.norm_topk_prob, cfg.moe_fp32_weights, tp, device, dtype, shard.expert_start, shard.num_local_experts,
    )  # fmt: skip


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TPGroup, shard: TPShard):
        super().__init__()
        device, dtype = rotary_emb.device, rotary_emb.dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb, tp, shard)
        self.post_attention_layernorm = AddRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = make_mlp(cfg, layer_id, tp, shard, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """`x` is this forward's own residual stream (the embedding output or a layer's sum): the
        fused residual add updates it in place."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, fb)
        h, x = self.post_attention_layernorm(attn, x)
        return x + self.mlp(h, fb)

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class GraniteDecoderLayer(LlamaDecoderLayer):
    """transformers' `GraniteDecoderLayer`: `x + sublayer(...) * residual_multiplier`."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TPGroup, shard: TPShard):
        super().__init__(cfg, layer_id, rotary_emb, tp, shard)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, fb)
        h, x = self.post_attention_layernorm(attn * self.residual_multiplier, x)
        return x + self.mlp(h, fb) * self.residual_multiplier

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class Olmo2DecoderLayer(nn.Module):
    """transformers' `Olmo2DecoderLayer`: `x + norm(attn(x))`, then `x + norm(mlp(x))`."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TPGroup, shard: TPShard):
        super().__init__()
        device, dtype = rotary_emb.device, rotary_emb.dtype
        eps, fp32_weight = cfg.rms_norm_eps, cfg.norm_weight_before_cast
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb, tp, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, device, dtype, fp32_weight)
        self.mlp = make_mlp(cfg, layer_id, tp, shard, device, dtype)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, device, dtype, fp32_weight)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, fb))
        return x + self.post_feedforward_layernorm(self.mlp(x, fb))

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


class SandwichDecoderLayer(nn.Module):
    """transformers' `Gemma2DecoderLayer` / `Gemma3DecoderLayer`: see the module docstring."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding, tp: TPGroup, shard: TPShard):
        super().__init__()
        device, dtype = rotary_emb.device, rotary_emb.dtype

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype, unit_offset=cfg.unit_offset_norms)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb, tp, shard)
        self.mlp = make_mlp(cfg, layer_id, tp, shard, device, dtype)
        self.eps = cfg.rms_norm_eps
        # bf16 on the fused kernels: each "residual += post_norm(y), then the next norm" is one
        # pass, the residual (the forward's own tensor) summed in place
        self.fused_steps = self.input_layernorm.uses_cpu_kernel and cfg.unit_offset_norms

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if self.fused_steps:
            h = self.self_attn(self.input_layernorm(x), cos, sin, fb)
            post, pre = self.post_attention_layernorm.weight, self.pre_feedforward_layernorm.weight
            h = self.mlp(cpu_elementwise.add_unit_norm_(x, h, post, pre, self.eps), fb)
            return cpu_elementwise.add_unit_norm_(x, h, self.post_feedforward_layernorm.weight, None, self.eps)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, fb))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), fb))

    __call__ = forward  # direct call, no hook dispatch (engine/layers/__init__.py)


DecoderLayer = LlamaDecoderLayer | GraniteDecoderLayer | Olmo2DecoderLayer | SandwichDecoderLayer


def decoder_layer_class(cfg: ModelConfig) -> type[DecoderLayer]:
    """The layer shape `cfg` calls for (see the module docstring)."""
    if cfg.sandwich_norms:
        return SandwichDecoderLayer
    if cfg.post_norms:
        return Olmo2DecoderLayer
    if cfg.residual_multiplier != 1.0:
        return GraniteDecoderLayer
    return LlamaDecoderLayer
