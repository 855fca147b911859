"""Native Llama-family decoder (Llama, Qwen2 with QKV bias, Qwen3 with q/k RMSNorm).

One implementation for the three: they differ only in biases and q/k norm (see ModelConfig).
Projections are fused (q|k|v in one matmul, gate|up in one) to cut per-layer kernel launches;
attention goes through the backend over the paged KV pool. Numerics follow transformers' op
order (RMSNorm in fp32, RoPE in fp32 then cast) so fp32 greedy output is token-identical.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.model_executor.forward_batch_info import ForwardBatch
from engine.kernels import cpu_elementwise
from engine.layers.norm import rms_norm
from engine.layers.quant_linear import OneDNNWeight, PackedInt4Weight, Q4Blocks, linear
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.model_config import ModelConfig

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool) -> torch.Tensor:
    return cpu_elementwise.rms_norm(x, weight, eps) if fused else rms_norm(x, weight, eps)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        self.input_norm = _param(h)
        self.qkv_w = _param(self.q_size + 2 * self.kv_size, h)
        self.qkv_b = _param(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.o_w = _param(h, self.q_size)
        self.o_b = _param(h) if cfg.o_bias else None
        self.q_norm = _param(d) if cfg.qk_norm else None
        self.k_norm = _param(d) if cfg.qk_norm else None
        self.post_norm = _param(h)
        self.gate_up_w = _param(2 * cfg.intermediate_size, h)
        self.gate_up_b = _param(2 * cfg.intermediate_size) if cfg.mlp_bias else None
        self.down_w = _param(h, cfg.intermediate_size)
        self.down_b = _param(h) if cfg.mlp_bias else None
        self.act = _ACTIVATIONS[cfg.hidden_act]
        # Packed 4-bit forms of the four weights, for small bf16 batches (see load_weights); None: dense only.
        self.qkv_q4: PackedInt4Weight | None = None
        self.o_q4: PackedInt4Weight | None = None
        self.gate_up_q4: PackedInt4Weight | None = None
        self.down_q4: PackedInt4Weight | None = None
        # The same four weights prepacked for oneDNN (CPU bf16, `prepack_onednn`); None: plain F.linear.
        self.qkv_dnn: OneDNNWeight | None = None
        self.o_dnn: OneDNNWeight | None = None
        self.gate_up_dnn: OneDNNWeight | None = None
        self.down_dnn: OneDNNWeight | None = None
        # CPU bf16: RMSNorm, residual add + RMSNorm, SiLU-and-mul and rotary as fused C++ ops
        # (kernels/cpu_elementwise.py); set by LlamaForCausalLM.use_fused_cpu_ops.
        self.fused = False

    def qk_norm_weight(self) -> torch.Tensor:
        """Qwen3's q_norm and k_norm weights as one [H + KVH, D] table for the fused q|k slab."""
        cfg = self.cfg
        return torch.cat([self.q_norm.expand(cfg.num_heads, -1), self.k_norm.expand(cfg.num_kv_heads, -1)])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        t = x.shape[0]
        h = _norm(x, self.input_norm, eps, self.fused)
        qkv = linear(h, self.qkv_w, self.qkv_b, self.qkv_q4, self.qkv_dnn)
        # q and k are adjacent in qkv: normalise and rotate them as one [t, H + KVH, D] slab
        # (half the per-layer elementwise ops of doing each; same per-element arithmetic).
        qk = qkv[:, : self.q_size + self.kv_size].view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            qk = rms_norm(qk, self.qk_norm_weight(), eps)
        qk = cpu_elementwise.rotary(qk, cos, sin) if self.fused else apply_rotary(qk, cos, sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        attn = fb.attn_backend.forward(q, k, v, self.layer_id, fb)
        o = linear(attn, self.o_w, self.o_b, self.o_q4, self.o_dnn)
        if self.fused:  # x is this forward's own residual stream (embedding output or a layer's sum)
            h = cpu_elementwise.add_rms_norm_(x, o, self.post_norm, eps)
        else:
            x = x + o
            h = rms_norm(x, self.post_norm, eps)
        gate_up = linear(h, self.gate_up_w, self.gate_up_b, self.gate_up_q4, self.gate_up_dnn)
        if self.fused and self.act is F.silu:
            act = cpu_elementwise.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = self.act(gate) * up
        return x + linear(act, self.down_w, self.down_b, self.down_q4, self.down_dnn)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, hf_config, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(hf_config, cfg.head_dim, device)
        self.head_dnn: OneDNNWeight | None = None  # see prepack_onednn
        self.fused = False  # see use_fused_cpu_ops

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] (last new token of each request), or [num_tokens, V] with prompt logits."""
        x = F.embedding(fb.input_ids, self.embed)
        cos, sin = self.rotary.cos_sin(fb.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, fb)
        if fb.forward_mode.is_extend() and not fb.return_prompt_logits:
            last = torch.tensor(fb.extend_seq_lens, device=x.device).cumsum(0) - 1
            x = x[last]
        x = _norm(x, self.norm, self.cfg.rms_norm_eps, self.fused)
        head = self.embed if self.lm_head is None else self.lm_head
        return linear(x, head, None, None, self.head_dnn).float()

    def use_fused_cpu_ops(self) -> bool:
        """Switch the layers to the fused C++ elementwise ops when they apply: CPU, bf16, the kernels
        built. Call after the final `.to(device, dtype)`; returns whether they are on."""
        on = (
            self.embed.device.type == "cpu" and self.embed.dtype == torch.bfloat16
            and self.cfg.hidden_size % 16 == 0 and self.cfg.intermediate_size % 16 == 0
            and self.cfg.head_dim % 32 == 0
            and cpu_elementwise.load() is not None
        )  # fmt: skip
        self.fused = on
        for layer in self.layers:
            layer.fused = on
        return on

    def prepack_onednn(self) -> int:
        """Reorder every dense projection (and the LM head) for oneDNN once; CPU bf16 only.

        Call after the final `.to(device, dtype)`. Returns how many weights were prepacked (0 when
        oneDNN prepacking does not apply). The dense weights stay: the int4 path and other code
        paths (fp32, other devices) never read the prepacked form.
        """
        n = 0
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                packed = OneDNNWeight.from_dense(getattr(layer, f"{name}_w"))
                setattr(layer, f"{name}_dnn", packed)
                n += packed is not None
        self.head_dnn = OneDNNWeight.from_dense(self.embed if self.lm_head is None else self.lm_head)
        return n + (self.head_dnn is not None)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor] | tuple[str, torch.Tensor, Q4Blocks | None]],
        q4_max_rows: int = 0,
    ) -> None:
        """Copy Hugging Face-named tensors into the fused parameters; every parameter must be set.

        Items may carry a third element, the weight's 4-bit blocks (`ModelSource.iter_weights_q4`).
        With `q4_max_rows > 0`, a fused weight whose every part came with blocks is also kept packed
        for the int4 kernel, used for inputs of at most that many rows; one dense part (or a shape
        the kernel cannot take) leaves that weight dense only.
        """
        cfg = self.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        # name suffix -> (our param attribute, row offset, row count) inside a fused parameter
        fused = {
            "self_attn.q_proj": ("qkv", 0, q), "self_attn.k_proj": ("qkv", q, kv),
            "self_attn.v_proj": ("qkv", q + kv, kv), "self_attn.o_proj": ("o", 0, None),
            "mlp.gate_proj": ("gate_up", 0, inter), "mlp.up_proj": ("gate_up", inter, inter),
            "mlp.down_proj": ("down", 0, None),
        }  # fmt: skip
        plain = {
            "input_layernorm.weight": "input_norm", "post_attention_layernorm.weight": "post_norm",
            "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
        }  # fmt: skip
        n_parts = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
        q4_parts: dict[tuple[int, str], dict[int, Q4Blocks | None]] = {}  # (layer, attr) -> row offset -> blocks
        seen: set[str] = set()
        for name, tensor, *extra in weights:
            if name == "model.embed_tokens.weight":
                self._copy(self.embed, tensor, name)
                seen.add("embed")
            elif name == "model.norm.weight":
                self._copy(self.norm, tensor, name)
                seen.add("norm")
            elif name == "lm_head.weight":
                if self.lm_head is not None:
                    self._copy(self.lm_head, tensor, name)
                    seen.add("lm_head")
            elif name.startswith("model.layers."):
                _, _, idx, rest = name.split(".", 3)
                layer = self.layers[int(idx)]
                module, _, kind = rest.rpartition(".")
                if rest in plain:
                    self._copy(getattr(layer, plain[rest]), tensor, name)
                    seen.add(f"{idx}.{plain[rest]}")
                elif module in fused:
                    attr, off, rows = fused[module]
                    target = getattr(layer, f"{attr}_{'w' if kind == 'weight' else 'b'}")
                    if target is None:
                        raise ModelLoadError(f"unexpected weight {name} for {cfg.architecture}")
                    rows = rows if rows is not None else target.shape[0]
                    self._copy(target.data[off : off + rows], tensor, name)
                    seen.add(f"{idx}.{module}.{kind}")
                    if kind == "weight" and q4_max_rows > 0:
                        parts = q4_parts.setdefault((int(idx), attr), {})
                        parts[off] = extra[0] if extra else None
                        if len(parts) == n_parts[attr]:  # every part is in: fuse (rows in order) and pack
                            del q4_parts[(int(idx), attr)]
                            blocks = [parts[o] for o in sorted(parts)]
                            if all(b is not None for b in blocks):
                                setattr(layer, f"{attr}_q4", Q4Blocks.cat(blocks).pack(q4_max_rows))
                elif "rotary_emb" not in rest:
                    raise ModelLoadError(f"unexpected weight {name} for {cfg.architecture}")
        missing = self._expected_names() - seen
        if missing:
            raise ModelLoadError(f"weights missing from checkpoint: {sorted(missing)[:8]}")

    def _expected_names(self) -> set[str]:
        names = {"embed", "norm"} | ({"lm_head"} if self.lm_head is not None else set())
        for i, layer in enumerate(self.layers):
            names |= {f"{i}.input_norm", f"{i}.post_norm"}
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
                names.add(f"{i}.{m}.weight")
            if layer.qkv_b is not None:
                names |= {f"{i}.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
            if layer.o_b is not None:
                names.add(f"{i}.self_attn.o_proj.bias")
            if layer.gate_up_b is not None:
                names |= {f"{i}.mlp.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")}
            if layer.q_norm is not None:
                names |= {f"{i}.q_norm", f"{i}.k_norm"}
        return names

    @staticmethod
    def _copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(target.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.data.copy_(tensor)


MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
