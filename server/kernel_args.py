"""The command line's CPU kernel and weight-quantization flags, kept beside cli.py, which is full.

--torch-threads N --q4-max-tokens N --q4-int8-activations --disable-fused-decode --torchao-config int8wo|int4wo-G
"""

from __future__ import annotations

import argparse
from typing import Any

from server.arg_types import non_negative_int, positive_int

# Mirrors engine.layers.weight_quant.TORCHAO_CONFIGS: the command line answers --help and bad
# flags before importing the engine (tests/test_startup_flags.py checks the two agree).
TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")

# engine options passed through as given (None: the engine's default)
KERNEL_OPTIONS = ("torch_threads", "q4_max_tokens", "torchao_config")


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CPU kernels and quantization")
    g.add_argument(
        "--torch-threads",
        type=positive_int,
        help="torch threads of the forward thread (default on a CPU: the physical cores this process may "
        "use; forwards of a few tokens then run with one fewer where the model is small enough that the "
        "event loop's core is worth more, measured at start-up per model and forward form)",
    )
    g.add_argument(
        "--q4-max-tokens",
        type=non_negative_int,
        help="CPU, bfloat16 or float32: forward passes of up to this many tokens run the linears on their "
        "quantized form (a GGUF's 4-bit blocks and Q8_0 head, or --torchao-config's); 0 disables "
        "(default: the crossover with the dense matmul, measured at start-up)",
    )
    g.add_argument(
        "--q4-int8-activations",
        action="store_true",
        help="CPU bfloat16: the 4-bit quantized loops read the activations in int8 blocks, as llama.cpp does "
        "(AVX512-VNNI: faster batched decode and prefill, less exact; process-wide)",
    )
    g.add_argument(
        "--disable-fused-decode",
        action="store_true",
        help="CPU bf16: run small decode batches layer by layer in Python instead of one C++ call per step",
    )
    g.add_argument(
        "--torchao-config",
        choices=TORCHAO_CONFIGS,
        help="weight-only quantization of a Hugging Face checkpoint's decoder-layer projections as it "
        "loads (SGLang's names): int8wo (Q8_0 blocks of 32) or int4wo-GROUP (asymmetric 4-bit groups); "
        "small batches read the quantized weights, larger ones their bf16 dequantized form "
        "(CPU, bfloat16, one rank; default: off)",
    )


def kernel_engine_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine options these flags set."""
    options = {k: getattr(ns, k) for k in KERNEL_OPTIONS if getattr(ns, k) is not None}
    for flag in ("disable_fused_decode", "q4_int8_activations"):
        if getattr(ns, flag):
            options[flag] = True
    return options
