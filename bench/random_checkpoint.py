"""Random-weight checkpoints with the exact shapes of popular models, for benchmarks at the sizes
people run (no download: SmolLM2's tokenizer, from the default model, is saved beside them):

    python -m bench.random_checkpoint llama-3.2-1b /tmp/llama1b-rand
    python -m bench.offline --model-path /tmp/llama1b-rand --workloads W1 single

A Hugging Face folder (bf16 safetensors, config.json, the tokenizer, generation_config.json), which
every engine here and its peers read; llama.cpp's `convert_hf_to_gguf.py` turns it into GGUF for
`llama-server` (../shared/peers). The vocabulary is SmolLM2's (49152), not the original's, so the
embedding and LM head are smaller than the real model's; every other shape is the model's own.
Weights are N(0, 0.02), norms 1, seeded: outputs are meaningless, costs are real.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine import resolve_model

VOCAB = 49152  # SmolLM2's tokenizer
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192, rms_norm_eps=1e-5)

# name -> (model_type, config fields)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-3.2-1b": (
        "llama",
        dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    "qwen3-1.7b": (
        "qwen3",
        dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
    # Gemma 2's layer (sandwich norms, GeGLU, soft-caps, local/global windows) at its 2B size
    "gemma-2-2b": (
        "gemma2",
        dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
             attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
             tie_word_embeddings=True),
    ),
    # A small MoE of realistic layout (Qwen3-MoE's: 128 experts, 8 routed, narrow experts) at a
    # size that fits a laptop: ~1.6B parameters, ~0.4B active per token.
    "qwen3-moe-small": (
        "qwen3_moe",
        dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_experts=128,
             num_experts_per_tok=8, norm_topk_prob=True, rope_theta=1000000.0, tie_word_embeddings=True),
    ),
}  # fmt: skip


def make_checkpoint(preset: str, out: Path, seed: int = 0, **overrides) -> int:
    """Write the random checkpoint of `preset` (fields overridden by `overrides`) into `out`;
    returns its parameter count."""
    model_type, fields = PRESETS[preset]
    cfg = AutoConfig.for_model(model_type, **(COMMON | fields | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    resolve_model("smollm2-135m").load_tokenizer().save_pretrained(str(out))
    generation = dict(bos_token_id=1, eos_token_id=2)
    (out / "generation_config.json").write_text(json.dumps(generation))
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = make_checkpoint(args.preset, args.out, args.seed)
    print(f"{args.preset}: {n / 1e9:.2f}B parameters in {args.out}")


if __name__ == "__main__":
    main()
