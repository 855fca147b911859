"""Checkpoints and greedy references for the weight-update, pause and memory tests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import Engine, SamplingParams
from tests.sched_harness import build_tiny_folder

PROMPTS = [[5, 17, 99, 3, 250, 7], [1200, 44, 9, 9, 31], [77] * 12]
NEW = 10
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)


def perturbed_copy(src: str, dst: Path, seed: int, scale: float = 0.1) -> str:
    """`src`'s model with every weight moved by seeded noise (another training step, say)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    model.save_pretrained(dst)
    for f in Path(src).iterdir():  # the tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())
    return str(dst)


def make_checkpoints(root: Path, tokenizer) -> dict[str, str]:
    """Checkpoint `a`, `b` (a's next step), `wide` (other shapes) and `missing` (a tensor short)."""
    a = build_tiny_folder(root / "a", tokenizer)
    b = perturbed_copy(a, root / "b", seed=1)
    # other shapes: a wider model
    wide = root / "wide"
    wide.mkdir()
    cfg = json.loads((Path(a) / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (wide / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(Path(a) / "model.safetensors"))
    grown = {
        k: torch.cat([v, v], dim=0 if "gate" in k or "up" in k else 1) if "mlp" in k else v for k, v in tensors.items()
    }
    save_file(grown, str(wide / "model.safetensors"))
    # a tensor missing
    missing = root / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((Path(a) / "config.json").read_text())
    save_file(
        {k: v for k, v in tensors.items() if "layers.1.mlp.down_proj" not in k}, str(missing / "model.safetensors")
    )
    return {"a": a, "b": b, "wide": str(wide), "missing": str(missing)}


def hf_greedy(folder: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in PROMPTS:
            gen = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
            outs.append(gen[0, len(ids) :].tolist())
    return outs


async def greedy(engine: Engine) -> list[list[int]]:
    return [r.token_ids for r in await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))]


def hf_named_tensors(folder: str) -> list[tuple[str, torch.Tensor]]:
    return list(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict().items())
