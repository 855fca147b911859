"""transformers' greedy outputs on the default GGUF, fp32: the ground truth of the parity tests."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def hf_greedy_outputs(source, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's generated ids (stopping at EOS as `generate` does), one prompt at a time."""
    path = source.gguf_file
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=new_tokens)
            outs.append(gen[0, len(ids) :].tolist())
    return outs
