"""GGUF files of the families llama.cpp writes beyond Llama/Qwen (issue 31), each a tiny random
model written as llama.cpp's converter writes it, against transformers on the same weights.

A Qwen3-MoE GGUF: (the
router as `ffn_gate_inp`, each layer's experts stacked in `ffn_{gate,up,down}_exps`
`[experts, rows, cols]`, the expert width in `qwen3moe.expert_feed_forward_length`), then:

- transformers' own GGUF reader gives back the original weights (the file is what llama.cpp
  writes, as far as transformers knows it), and our reader yields the per-expert tensors of the
  original checkpoint;
- served from the GGUF in fp32, greedy tokens and prompt log-probs equal transformers' on the
  original model (test_model_families.py's scheduler run);
- experts stored Q8_0 load dequantized exactly as transformers dequantizes them.

A Phi-3 GGUF (fused `attn_qkv` stored Q8_0 and `ffn_up` = gate|up; partial rotary from
`rope.dimension_count`; a sliding window; longrope factors from `rope_factors_long/short`):
its config is the checkpoint's, and fp32 greedy tokens equal transformers' on the GGUF's values.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, MixtralConfig, Phi3Config, Qwen3MoeConfig

from engine.layers.moe import FusedMoE
from engine.layers.moe_quant import QuantExperts
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from tests.test_loader import llama_cpp_permute
from tests.test_model_families import (
    COMMON,
    FAMILIES,
    NO_SPECIAL,
    assert_scheduler_matches_transformers,
    family_args,
    save_random_model,
)

Q8 = GGMLQuantizationType.Q8_0
CONFIG = dict(COMMON, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "mlp.gate.weight": "ffn_gate_inp",
}


def tiny_qwen3moe(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**(CONFIG | overrides), norm_topk_prob=True, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def write_qwen3moe_gguf(path, model, expert_type: GGMLQuantizationType = GGMLQuantizationType.F32, expert_bytes=None):
    write_moe_gguf(path, model, "qwen3moe", expert_type, expert_bytes)


def write_moe_gguf(path, model, arch: str, expert_type: GGMLQuantizationType = GGMLQuantizationType.F32,
                   expert_bytes=None) -> None:  # fmt: skip
    """`model` (Qwen3-MoE or Mixtral) as llama.cpp's converter writes it for `arch`: "qwen3moe"
    (the expert width as its own key, head sizes, q/k norms) or "llama" (Mixtral: q/k rows
    permuted, the expert width as the feed-forward length); the router `ffn_gate_inp`, the experts
    stacked in `ffn_{gate,up,down}_exps`, stored as `expert_type` (quantized by gguf), or where
    `expert_bytes(proj, (experts, rows, cols))` gives (qtype, bytes), those blocks instead of the
    model's values (gguf cannot quantize to the K-quants)."""
    cfg = model.config
    mixtral = arch == "llama"
    inter = cfg.intermediate_size if mixtral else cfg.moe_intermediate_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_count(cfg.num_local_experts if mixtral else cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(inter)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    for hf, name in GLOBAL.items():
        w.add_tensor(name, sd[hf])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    permuted = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads} if mixtral else {}
    raw = None if expert_type == GGMLQuantizationType.F32 else expert_type
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf, name in LAYER.items():
            if p + hf not in sd:  # Mixtral has no q/k norms
                continue
            data, proj = sd[p + hf], hf.split(".")[1]
            if proj in permuted:
                data = np.ascontiguousarray(llama_cpp_permute(data, permuted[proj]))
            w.add_tensor(f"blk.{i}.{name}.weight", data)
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        stacks = {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": sd[p + "mlp.experts.down_proj"]}
        for proj, data in stacks.items():
            data, qtype = np.ascontiguousarray(data), raw
            if expert_bytes is not None:
                qtype, data = expert_bytes(proj, data.shape)
            elif raw is not None:
                data = gguf.quants.quantize(data, raw)
            w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def per_expert(model) -> dict[str, torch.Tensor]:
    """The original model's weights as a checkpoint names them (one tensor per expert projection)."""
    out = {}
    inter = model.config.moe_intermediate_size
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    model = tiny_qwen3moe()
    path = tmp_path_factory.mktemp("qwen3moe-gguf") / "tiny-qwen3moe.gguf"
    write_qwen3moe_gguf(path, model)
    return path, model


def test_the_gguf_reads_back_as_the_original_checkpoint(moe_gguf):
    path, model = moe_gguf
    src = resolve_model(str(path))
    assert src.architecture == "Qwen3MoeForCausalLM" and src.gguf_file == path
    cfg = src.hf_config
    assert (cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok) == (32, 8, 2)
    assert cfg.norm_topk_prob and cfg.head_dim == 16
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=cfg, dtype=torch.float32)
    for name, tensor in model.state_dict().items():  # the writer's layout is the one transformers reads
        assert torch.equal(ref.state_dict()[name], tensor), name
    got, want = dict(src.iter_weights()), per_expert(model)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_greedy_tokens_from_the_gguf_equal_transformers(moe_gguf):
    path, model = moe_gguf
    runner = ModelRunner(family_args(str(path)))
    assert_scheduler_matches_transformers(runner, model, "qwen3moe-gguf")


def test_q8_experts_dequantize_as_transformers_does(tmp_path):
    model = tiny_qwen3moe(seed=1)
    path = tmp_path / "q8.gguf"
    write_qwen3moe_gguf(path, model, GGMLQuantizationType.Q8_0)
    src = resolve_model(str(path))
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, config=src.hf_config, dtype=torch.float32
    )
    got = dict(src.iter_weights())
    for name, want in per_expert(ref).items():
        assert torch.equal(got[name], want), name
    quantized = got["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert not torch.equal(quantized, per_expert(model)["model.layers.0.mlp.experts.3.up_proj.weight"])


# --- Phi-3 -----------------------------------------------------------------------------------

PHI3_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.qkv_proj.weight": "attn_qkv",  # fused q|k|v, as llama.cpp keeps it
    "self_attn.o_proj.weight": "attn_output",
    "mlp.gate_up_proj.weight": "ffn_up",  # fused gate|up
    "mlp.down_proj.weight": "ffn_down",
}
PHI3 = {  # variant -> (config, weight init), Phi-3 shapes from test_model_families.py
    "phi3-partial-rotary-window": (
        lambda: Phi3Config(**COMMON, partial_rotary_factor=0.5, sliding_window=12),
        FAMILIES["phi3-partial-rotary"][1],
    ),
    "phi3-longrope-tied": FAMILIES["phi3-longrope-tied"],
}


def q8_qkv(gguf_name: str, data: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """The fused q|k|v quantized (read dequantized), every other tensor as it is."""
    if data.ndim == 2 and gguf_name.endswith("attn_qkv.weight"):
        return gguf.quants.quantize(data, Q8), Q8
    return data, None


def write_phi3_gguf(path, model, encode=q8_qkv) -> None:
    """`model` as llama.cpp's converter writes a Phi-3: the rotary's width as
    `rope.dimension_count`, longrope's factors as the tensors `rope_factors_long/short`; `encode`
    (GGUF name, values) -> (what the file holds, its quantized type or None) chooses each
    matrix's storage."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_vocab_size(cfg.vocab_size)
    if cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        stored, qtype = encode("output.weight", sd["lm_head.weight"])
        w.add_tensor("output.weight", stored, raw_dtype=qtype)
    for i in range(cfg.num_hidden_layers):
        for hf, name in PHI3_LAYER.items():
            gguf_name = f"blk.{i}.{name}.weight"
            stored, qtype = encode(gguf_name, sd[f"model.layers.{i}.{hf}"])
            w.add_tensor(gguf_name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(PHI3))
def test_phi3_gguf_serves_as_its_checkpoint(name, tmp_path):
    """A Phi-3 GGUF's config is the checkpoint's (partial rotary, window, longrope from what
    llama.cpp stores); fp32 greedy tokens equal transformers' on the same (dequantized) weights."""
    cfg, init = PHI3[name]
    model = save_random_model(cfg(), init, tmp_path / "hf")
    path = tmp_path / "tiny-phi3.gguf"
    write_phi3_gguf(path, model)
    src = resolve_model(str(path))
    assert src.architecture == "Phi3ForCausalLM"
    want, got = model.config, src.hf_config
    assert got.rope_parameters.get("partial_rotary_factor", 1.0) == want.rope_parameters.get(
        "partial_rotary_factor", 1.0
    )
    assert got.sliding_window == want.sliding_window
    for key in ("rope_type", "long_factor", "short_factor"):
        assert got.rope_parameters.get(key) == pytest.approx(want.rope_parameters.get(key)), key
    assert getattr(got, "original_max_position_embeddings", None) == want.original_max_position_embeddings
    # the reference: transformers on the GGUF's own (dequantized) values, with the checkpoint's config
    ref_cfg = copy.deepcopy(got)  # Phi3Config's special ids (32000) are past the tiny vocabulary
    ref_cfg.update(NO_SPECIAL)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=ref_cfg, dtype=torch.float32)
    got_weights = dict(src.iter_weights())
    for hf_name, tensor in ref.state_dict().items():
        if hf_name in got_weights:
            assert torch.equal(got_weights[hf_name], tensor), hf_name
    runner = ModelRunner(family_args(str(path)))
    assert_scheduler_matches_transformers(runner, ref, name)


# --- Mixtral (a "llama" GGUF with experts) ---------------------------------------------------

MIXTRAL_SHAPE = dict(COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("expert_type", [GGMLQuantizationType.F32, GGMLQuantizationType.Q4_0])
def test_a_mixtral_gguf_serves_as_its_checkpoint(expert_type, tmp_path):
    """Loaded as MixtralForCausalLM (transformers reads it as a dense Llama); fp32 greedy tokens
    and prompt log-probs equal transformers' Mixtral on the file's values (Q4_0 experts: the
    checkpoint's experts replaced by gguf's own dequantization of their blocks)."""
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(MixtralConfig(**MIXTRAL_SHAPE), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    path = tmp_path / "tiny-mixtral.gguf"
    write_moe_gguf(path, model, "llama", expert_type)
    if expert_type != GGMLQuantizationType.F32:
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if ".mlp.experts." in name:  # what the file holds
                    blocks = gguf.quants.quantize(t.numpy(), expert_type)
                    t.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, expert_type)).view_as(t))
    src = resolve_model(str(path))
    assert src.architecture == "MixtralForCausalLM"
    cfg = src.hf_config
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (4, 2, 64)
    assert cfg.sliding_window is None
    runner = ModelRunner(family_args(str(path)))
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moe) == cfg.num_hidden_layers
    assert all(
        (m.quant is not None) == (expert_type != GGMLQuantizationType.F32) for m in moe
    ) or not QuantExperts.available(torch.float32)
    assert_scheduler_matches_transformers(runner, model, f"mixtral-gguf-{expert_type.name}")
