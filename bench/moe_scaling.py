"""Does a MoE step cost more with more experts at equal active parameters? One run:

    python -m bench.moe_scaling [--experts 8 64] [--layers 4]

Random Qwen3-MoE checkpoints (bench.random_checkpoint's `qwen3-moe-small` layout with `--layers`
layers), identical but for the number of experts (top-2 of each, the same expert width: the
same routed work per token, 8x the expert weights at 64). bench.offline's W3 (32 requests,
32-token prompts, 256 tokens each: decode-bound) and `single` run through our `Engine` with its
defaults on each. Prints output tok/s and the ratio to the fewest experts, with the CPU's ISA.
With tokens grouped by expert (engine/layers/moe.py), a step runs one gate|up and one down GEMM
per expert that has tokens: more experts means more, smaller GEMMs (and more weight read per
step), not more work per token.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.offline import make_workload, run_ours
from bench.random_checkpoint import VOCAB, make_checkpoint
from bench.weight_update import cpu_isa
from engine import ServerArgs


def main(argv: list[str] | None = None) -> dict[tuple[str, int], float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["W3", "single"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = ap.parse_args(argv)
    dtype = ServerArgs(model_path="", dtype=args.dtype).resolved_dtype()  # what a user gets
    print(f"isa={cpu_isa()} layers={args.layers} top-2, moe_intermediate 256, dtype {args.dtype} = {dtype}")
    tps: dict[tuple[str, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.experts:
            folder = Path(tmp) / f"moe{n}"
            params = make_checkpoint("qwen3-moe-small", folder, num_hidden_layers=args.layers, num_experts=n,
                                     num_experts_per_tok=2)  # fmt: skip
            ns = argparse.Namespace(
                model_path=str(folder), dtype=str(dtype).removeprefix("torch."), threads=None, max_total_tokens=None,
                disable_cascade_attention=False,
            )  # fmt: skip
            for name in args.workloads:
                r = run_ours(make_workload(name, VOCAB, 0), ns)
                tps[(name, n)] = r.tokens_per_s
                base = tps[(name, args.experts[0])]
                print(
                    f"  {n:3d} experts ({params / 1e6:.0f}M params) {name:>7}: {r.tokens_per_s:7.1f} tok/s, "
                    f"{r.tokens_per_s / base:.2f}x {args.experts[0]} experts",
                    flush=True,
                )
    return tps


if __name__ == "__main__":
    main()
