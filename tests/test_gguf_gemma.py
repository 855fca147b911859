"""Gemma 2 and Gemma 3 GGUF files (issue 31), each a tiny random model written as llama.cpp's
converter writes it: every norm weight stored plus one (llama.cpp's RMSNorm scales by w, Gemma's
by 1 + w), the sandwich norms under llama.cpp's names (`ffn_norm` is the norm *before* the MLP),
no LM head (tied), the soft-caps and the window as metadata, Gemma 3's global RoPE base and linear
scaling as `rope.freq_base` / `rope.scaling.*`, and nothing for the query scale (llama.cpp derives
it from the model's size). Then:

- the config served is the checkpoint's: the query scale, soft-caps, window, layer pattern and
  per-layer-type RoPE, where transformers' GGUF reader keeps class defaults (its query scale of
  256, and Gemma 3's scaling dropped);
- the weights are transformers' reading of the same file (norms back to w, a Q8_0 projection
  dequantized alike), and within fp32 rounding of the original checkpoint's;
- served from the GGUF in fp32, greedy tokens and prompt log-probs equal transformers' on it
  (test_model_families.py's scheduler run: chunked prompts, a request joining, a radix hit).
"""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from engine.model_executor.model_runner import ModelRunner
from engine.models.gguf_config import complete_gguf_config
from engine.models.gguf_weights import GGUFIndex
from engine.models.loader import resolve_model
from tests.test_model_families import (
    COMMON,
    NO_SPECIAL,
    assert_scheduler_matches_transformers,
    family_args,
    save_random_model,
)

GEMMA_INIT = (0.3, -0.5, 0.5, 0.3)  # Gemma's norms scale by 1 + w: w around 0
LINEAR8 = {"rope_type": "linear", "factor": 8.0}  # Gemma 3 4B/12B/27B's global layers
SOFTCAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)  # tight: the caps bite
VARIANTS = {
    "gemma2": lambda: Gemma2Config(**COMMON, head_dim=16, sliding_window=12, query_pre_attn_scalar=16),
    "gemma2-softcaps-tight": lambda: Gemma2Config(
        **(COMMON | SOFTCAPS), head_dim=16, sliding_window=24, query_pre_attn_scalar=16
    ),
    # 7 layers: llama.cpp's fixed pattern (5 local, 1 global) and one more local layer
    "gemma3-linear-rope": lambda: Gemma3TextConfig(
        **(COMMON | dict(num_hidden_layers=7)),
        head_dim=16,
        sliding_window=10,
        query_pre_attn_scalar=16,
        rope_scaling=LINEAR8,
    ),
}
ARCH = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
Q8 = gguf.GGMLQuantizationType.Q8_0


def q8_attn_q(gguf_name: str, data: np.ndarray) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """One quantized projection per layer (q), read dequantized; every other tensor as it is."""
    if gguf_name.endswith("attn_q.weight"):
        return gguf.quants.quantize(data, Q8), Q8
    return np.ascontiguousarray(data), None


def write_gemma_gguf(path: Path, model, encode=q8_attn_q) -> None:
    """`model` as llama.cpp's converter writes a Gemma 2 / Gemma 3 (see the module doc); `encode`
    (GGUF name, values) -> (what the file holds, its quantized type or None) chooses each tensor's
    storage."""
    cfg = model.config
    arch = ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp's converter skips it
            continue
        data = tensor.numpy() + (1 if name.endswith("norm.weight") else 0)
        gguf_name = names.get_name(name.removesuffix(".weight")) + ".weight"
        stored, qtype = encode(gguf_name, data)
        w.add_tensor(gguf_name, stored, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gemma_gguf_serves_as_its_checkpoint(name, tmp_path):
    model = save_random_model(VARIANTS[name](), GEMMA_INIT, tmp_path / "hf")
    path = tmp_path / f"tiny-{name}.gguf"
    write_gemma_gguf(path, model)
    src = resolve_model(str(path))
    want, got = model.config, src.hf_config
    assert src.architecture == want.architectures[0]
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window"):
        assert getattr(got, key) == getattr(want, key), key
    assert got.layer_types == want.layer_types and got.rope_parameters == want.rope_parameters
    # the reference: transformers on the GGUF's own values, with the checkpoint's config
    ref_cfg = copy.deepcopy(got)
    ref_cfg.update(NO_SPECIAL)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, config=ref_cfg, dtype=torch.float32)
    ours, original = dict(src.iter_weights()), model.state_dict()
    assert ours.keys() == original.keys() - {"lm_head.weight"}
    for key, tensor in ours.items():
        assert torch.equal(tensor, ref.state_dict()[key]), key
        if key.endswith("norm.weight"):  # stored plus one, taken off: fp32 rounding only
            torch.testing.assert_close(tensor, original[key], rtol=0, atol=1e-6)
    runner = ModelRunner(family_args(str(path)))
    assert_scheduler_matches_transformers(runner, ref.eval(), name)


@pytest.mark.parametrize(
    "arch,layers,hidden,heads,head_dim,scalar",
    [
        ("gemma2", 26, 2304, 8, 256, 256),  # Gemma 2 2B
        ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads, as llama.cpp
        ("gemma3", 26, 1152, 4, 256, 256),  # Gemma 3 1B
        ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
    ],
)
def test_the_query_scale_is_llama_cpps(arch, layers, hidden, heads, head_dim, scalar):
    """The released models' `query_pre_attn_scalar`, from what their GGUF has (no key for it)."""
    config_class = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
    shape = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim)
    cfg = config_class(**shape, num_key_value_heads=heads // 2, query_pre_attn_scalar=256)
    meta = {"general.architecture": arch, f"{arch}.attention.sliding_window": 4096}
    complete_gguf_config(cfg, GGUFIndex(Path("x.gguf"), meta, ()))
    assert cfg.query_pre_attn_scalar == scalar


def test_a_gemma3_gguf_without_a_window_has_only_global_layers():
    cfg = Gemma3TextConfig(num_hidden_layers=7, head_dim=16, hidden_size=64, num_attention_heads=4)
    complete_gguf_config(cfg, GGUFIndex(Path("x.gguf"), {"general.architecture": "gemma3"}, ()))
    assert cfg.sliding_window is None and cfg.layer_types == ["full_attention"] * 7
    assert cfg.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 1_000_000.0}
