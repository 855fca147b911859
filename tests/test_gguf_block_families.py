"""Gemma 2, Gemma 3 and Phi-3 GGUFs in llama.cpp's Q4_K_M layout run from their own blocks (issues
31 and 33: one resident form of each weight). These files used to be dequantized at load: a
Q4_K_M Gemma held ~4x its file's bytes in bf16 and decoded at the dense weights' rate.

The layout is llama.cpp's Q4_K_M for these families (`llama_tensor_get_type`): Q4_K matrices, Q6_K
for v and down in some layers (here layer 0), Phi-3's fused q|k|v as Q5_K (cut into q, k and v
with their rows of the blocks, then fused back into one projection), and the head Q6_K (Gemma's
tied embedding: the lookup reads it dequantized, the head its blocks). Blocks are random bytes with
bounded factors (tests/test_gguf_kquants.py); the reference is transformers reading the same file.

- every layer matrix and the head run a block form, and the blocks are the projection's only
  resident form (more rows: their dequantized tiles, no dense copy);
- fp32: greedy tokens and prompt log-probs equal transformers' through the scheduler (chunked
  prompts, a request joining, a radix hit), on the Python layers (Gemma) and the fused decode loop
  (Phi-3);
- bf16: greedy tokens are transformers' top choices on the file's values (the bf16 bar).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, Phi3Config

from engine.kernels import cpu_quant
from engine.layers.fused_decode import FusedDecodeLayers
from engine.layers.int4 import TiledQ4Weight
from engine.layers.linear import DequantTilesLinear, QuantLinear, QuantParts
from engine.layers.q8 import Q8Weight
from engine.model_executor.model_runner import ModelRunner
from engine.models.loader import resolve_model
from tests.test_gguf_families import write_phi3_gguf
from tests.test_gguf_gemma import write_gemma_gguf
from tests.test_gguf_kquants import Q4_K, Q5_K, Q6_K, VECTOR, kquant_bytes
from tests.test_gguf_kquants import SHAPE as KQUANT_SHAPE
from tests.test_model_families import (
    NO_SPECIAL,
    VOCAB,
    assert_bf16_bar,
    assert_scheduler_matches_transformers,
    family_args,
)

# K-quant rows are 256 wide: test_gguf_kquants' tiny shape (hidden 256, 4 heads of 64: o's input)
SHAPE = {k: v for k, v in KQUANT_SHAPE.items() if k not in ("num_hidden_layers", "tie_word_embeddings")}
CONFIGS = {
    "gemma2": lambda: Gemma2Config(
        **SHAPE, num_hidden_layers=2, head_dim=64, sliding_window=24, query_pre_attn_scalar=64
    ),
    # llama.cpp's fixed pattern: layers 0-4 local, 5 global, 6 local
    "gemma3": lambda: Gemma3TextConfig(
        **SHAPE, num_hidden_layers=7, head_dim=64, sliding_window=10, query_pre_attn_scalar=64
    ),
    "phi3": lambda: Phi3Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=False),
}
# llama.cpp's Q4_K_M choices by GGUF tensor name (layer 0 stands for the layers it gives Q6_K)
Q6K_IN_LAYER_0 = ("attn_v", "ffn_down")


def q4_k_m(embedding: GGMLQuantizationType | None):
    """An `encode` for the GGUF writers: what a Q4_K_M file holds for each matrix, random blocks of
    its kind (seeded by the name); the embedding table as `embedding` (None: as it is)."""

    def encode(gguf_name: str, data: np.ndarray) -> tuple[np.ndarray, GGMLQuantizationType | None]:
        if data.ndim != 2:
            return np.ascontiguousarray(data), None
        if gguf_name == "token_embd.weight":
            qtype = embedding
        elif gguf_name == "output.weight":
            qtype = Q6_K
        elif gguf_name.endswith("attn_qkv.weight"):
            qtype = Q5_K
        elif gguf_name.startswith("blk.0.") and gguf_name.split(".")[2] in Q6K_IN_LAYER_0:
            qtype = Q6_K
        else:
            qtype = Q4_K
        if qtype is None:
            return np.ascontiguousarray(data), None
        return kquant_bytes(qtype, *data.shape, np.random.default_rng(sum(gguf_name.encode()))), qtype

    return encode


def write_q4_k_m(arch: str, path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # Gemma's norms scale by 1 + w: w around 0; Phi-3's by w
                p.uniform_(-0.5, 0.5) if "gemma" in arch else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 1.0)
    if "gemma" in arch:  # tied: the head is the embedding's Q6_K blocks
        write_gemma_gguf(path, model, encode=q4_k_m(Q6_K))
    else:
        write_phi3_gguf(path, model, encode=q4_k_m(None))


def reference(path):
    src = resolve_model(str(path))
    cfg = copy.deepcopy(src.hf_config)
    cfg.update(NO_SPECIAL)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=cfg, dtype=torch.float32)
    return hf.eval()


def is_q4_k(form) -> bool:
    return isinstance(form, TiledQ4Weight) and form.tiles.k_form


def is_q6_k(form) -> bool:
    return isinstance(form, Q8Weight) and form.supers is not None


def is_q5_k(form) -> bool:
    return isinstance(form, Q8Weight) and form.scales.dtype == torch.uint8  # Q5_K's sc and m


def assert_blocks_only(model, arch: str) -> None:
    """Each projection and the head in the Q4_K_M layout's forms, no dense copy beside them."""
    for i, layer in enumerate(model.layers):
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
        for m in (qkv, o, gate_up, down):
            assert isinstance(m, QuantLinear) and isinstance(m.big, DequantTilesLinear), (i, m)
        if arch == "phi3":  # the file's fused Q5_K tensor, cut and fused back: one form
            assert is_q5_k(qkv.packed)
        elif i == 0:  # Q4_K q|k beside a Q6_K v
            q_k, v = qkv.packed.forms
            assert isinstance(qkv.packed, QuantParts) and is_q4_k(q_k) and is_q6_k(v)
        else:
            assert is_q4_k(qkv.packed)
        assert is_q4_k(o.packed) and is_q4_k(gate_up.packed)
        assert is_q6_k(down.packed) if i == 0 else is_q4_k(down.packed)
    head = model.lm_head
    assert isinstance(head, QuantLinear) and is_q6_k(head.packed)


@VECTOR
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_q4_k_m_file_runs_its_blocks_as_transformers_reads_them(arch, tmp_path):
    path = tmp_path / f"tiny-{arch}-q4_k_m.gguf"
    write_q4_k_m(arch, path)
    ref = reference(path)
    # every row count up to 16 on the blocks (a measured crossover may keep this tiny model dense)
    runner = ModelRunner(family_args(str(path), q4_max_tokens=16))
    assert_blocks_only(runner.model, arch)
    # Phi-3's layer is Llama's: the fused decode loop runs it on the blocks; Gemma's is not
    assert isinstance(runner.model.fused_decode, FusedDecodeLayers) == (arch == "phi3")
    assert_scheduler_matches_transformers(runner, ref, arch)


@pytest.mark.skipif(not cpu_quant.vectorized(torch.bfloat16), reason="no AVX512-BF16 build of the block loops")
@pytest.mark.parametrize("arch", ["gemma2", "phi3"])
def test_a_bf16_q4_k_m_file_runs_its_blocks(arch, tmp_path):
    path = tmp_path / f"tiny-{arch}-q4_k_m.gguf"
    write_q4_k_m(arch, path)
    runner = ModelRunner(family_args(str(path), dtype="bfloat16", q4_max_tokens=16, chunked_prefill_size=None))
    assert_blocks_only(runner.model, arch)
    assert_bf16_bar(runner, reference(path), arch, vocab=VOCAB, lengths=(4, 37, 12, 60), new_tokens=16)
