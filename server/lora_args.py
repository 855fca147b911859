"""The multi-LoRA flags of the command line (SGLang's names), kept beside cli.py, which is full.

    --enable-lora --lora-paths name=path [name=path ...] --max-loras-per-batch N
    --max-loaded-loras N --max-lora-rank R --lora-target-modules q_proj v_proj ... | all

`--lora-paths` alone turns LoRA on (SGLang's rule, applied by `ServerArgs.verify`).
"""

from __future__ import annotations

import argparse
from typing import Any

from server.arg_types import positive_int

# engine options passed through as given (None: the engine's default)
LORA_OPTIONS = ("lora_paths", "max_loras_per_batch", "max_loaded_loras", "max_lora_rank", "lora_target_modules")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths)")
    g.add_argument(
        "--lora-paths",
        nargs="+",
        metavar="NAME=PATH",
        help="PEFT LoRA adapter folders to load at start-up, as name=path (or a path, named by itself); "
        "a request picks one by name (`lora_path`, or OpenAI's `model`)",
    )
    g.add_argument(
        "--max-loras-per-batch", type=positive_int, help="distinct adapters in one forward (device slots; default: 8)"
    )
    g.add_argument("--max-loaded-loras", type=positive_int, help="adapters kept on the host (default: no bound)")
    g.add_argument(
        "--max-lora-rank", type=positive_int, help="largest adapter rank (default: the most in --lora-paths, else 16)"
    )
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        metavar="MODULE",
        help="modules adapters may adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, or all "
        "(default: those --lora-paths adapt, every one without any)",
    )


def lora_engine_options(ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(ns, k) for k in LORA_OPTIONS if getattr(ns, k) is not None}
    if ns.enable_lora or ns.lora_paths:
        out["enable_lora"] = True
    return out
