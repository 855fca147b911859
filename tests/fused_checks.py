"""What the fused decode loop's tests share (tests/test_fused_decode*.py): the check that every
fused forward also runs the Python layers on the same input and KV state and matches them to the
bit, the tiny Qwen/Llama shape with head_dim 64 (the attention kernels' smallest), a random Qwen2
or Qwen3 checkpoint of it, and a tiny Llama with two real PEFT adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.layers.fused_decode import FusedDecodeLayers

# Qwen2 (q|k|v biases), Qwen3 (q/k norm) and Llama with head_dim 64, the kernels' smallest
QWEN_SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def check_every_fused_forward(monkeypatch, model, lora_rows: list[int] | None = None) -> list[tuple[str, int]]:
    """Make every fused forward also run the Python layers on the same input first (writing the
    same K/V) and assert the outputs are bit-identical; returns (forward mode, rows) per call
    (and appends each call's adapter row count to `lora_rows`)."""
    fused_forward = FusedDecodeLayers.forward
    seen: list[tuple[str, int]] = []

    def checked(self, x, cos, sin, fb, plan):
        reference = x.clone()
        for layer in model.layers:
            reference = layer(reference, cos, sin, fb)
        out = fused_forward(self, x, cos, sin, fb, plan)
        assert out.dtype == reference.dtype and torch.equal(out, reference)
        seen.append((fb.forward_mode.name, x.shape[0]))
        if lora_rows is not None:
            lora_rows.append(0 if fb.lora is None else fb.lora.num_lora_rows)
        return out

    monkeypatch.setattr(FusedDecodeLayers, "forward", checked)
    return seen


def llama_with_adapters(tmp_path: Path) -> tuple[Any, dict]:
    """A tiny random Llama of QWEN_SHAPE saved under tmp_path/base and two PEFT adapters of it
    ("all": every projection at r=4, "rslora": rsLoRA r=8 on q/v/down): the model source and the
    ServerArgs options serving them with one adapter slot fewer than adapters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.loader import resolve_model
    from tests.lora_fixtures import LLAMA_ADAPTERS, wrap

    torch.manual_seed(0)
    shape = {k: v for k, v in QWEN_SHAPE.items() if k != "rms_norm_eps"}
    hf = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    hf.save_pretrained(tmp_path / "base", safe_serialization=True)
    paths = []
    for i, name in enumerate(("all", "rslora")):
        wrap(hf, name, LLAMA_ADAPTERS[name], seed=50 + i, scale=0.05).save_pretrained(tmp_path / name)
        paths.append(f"{name}={tmp_path / name}")
    return resolve_model(str(tmp_path / "base")), dict(lora_paths=paths, max_loras_per_batch=1)


def random_qwen(qwen2: bool, folder: Path) -> Any:
    """A random fp32 transformers Qwen2 (q|k|v biases) or Qwen3 (q/k norm) of QWEN_SHAPE, every
    weight drawn (biases and norm weights included), saved as safetensors in `folder`."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    config = Qwen2Config(**QWEN_SHAPE) if qwen2 else Qwen3Config(**QWEN_SHAPE, head_dim=64)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf
