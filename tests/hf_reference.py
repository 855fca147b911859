"""transformers' greedy outputs on the default GGUF, fp32: the ground truth of the parity tests."""

from __future__ import annotations

import torch


def hf_greedy_outputs(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's generated ids (stopping at EOS as `generate` does), one prompt at a time, by
    `model` (the session's `hf_default_model`: loading the GGUF again costs ~20 s)."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            inp = torch.tensor([ids])
            gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=new_tokens)
            outs.append(gen[0, len(ids) :].tolist())
    return outs
