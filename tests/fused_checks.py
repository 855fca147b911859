"""A check shared by the fused decode loop's tests (tests/test_fused_decode*.py): every fused
forward also runs the Python layers on the same input and KV state, and must match to the bit."""

from __future__ import annotations

import torch

from engine.layers.fused_decode import FusedDecodeLayers


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
