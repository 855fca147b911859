"""The command line's hybrid sliding-window KV memory flags (SGLang's names), beside cli.py, which is full.

--disable-hybrid-swa-memory --swa-full-tokens-ratio F
"""

from __future__ import annotations

import argparse
from typing import Any

from server.arg_types import fraction


def add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sliding-window KV memory")
    g.add_argument(
        "--disable-hybrid-swa-memory",
        action="store_true",
        help="sliding-window models (Mistral, Gemma 2/3, Phi-3): keep every layer's KV for every position in "
        "one pool instead of a smaller pool for the local layers that releases what left the window",
    )
    g.add_argument(
        "--swa-full-tokens-ratio",
        type=fraction,
        help="size of the local layers' KV pool relative to the full-attention one (default: 0.8)",
    )


def kv_engine_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine options these flags set."""
    options: dict[str, Any] = {}
    if ns.disable_hybrid_swa_memory:
        options["disable_hybrid_swa_memory"] = True
    if ns.swa_full_tokens_ratio is not None:
        options["swa_full_tokens_ratio"] = ns.swa_full_tokens_ratio
    return options
