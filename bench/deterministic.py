"""What `--enable-deterministic-inference` costs, measured in one run:

    python -m bench.deterministic [--workloads W1 single] [--rounds 2]

Each workload of bench.offline runs through our `Engine` with its defaults and with the flag,
alternating (`rounds` times each, the best kept: a shared machine's noise only slows a run).
Prints output tok/s of both, the ratio (deterministic / default) and the CPU's vector ISA: the
cost depends on what the default path gains from the batch (the 4-bit kernel for small batches,
oneDNN's row-count-specific kernels, cascade attention, the fused decode loop), all given up.
"""

from __future__ import annotations

import argparse

from bench.offline import Result, make_workload, run_ours
from bench.weight_update import cpu_isa
from engine import resolve_model


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workloads", nargs="+", default=["W1"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    # bench.offline's options, at the engine's defaults
    ns = argparse.Namespace(
        model_path=args.model_path,
        dtype=args.dtype,
        threads=None,
        max_total_tokens=None,
        disable_cascade_attention=False,
    )
    vocab = resolve_model(args.model_path).hf_config.vocab_size
    print(f"model={args.model_path} dtype={args.dtype} isa={cpu_isa()} rounds={args.rounds}")
    ratios: dict[str, float] = {}
    for name in args.workloads:
        wl = make_workload(name, vocab, args.seed)
        best: dict[bool, Result] = {}
        for _ in range(args.rounds):
            for det in (False, True):
                r = run_ours(wl, ns, enable_deterministic_inference=det)
                label = "deterministic" if det else "default"
                print(f"  {name:>8} {label:>14}: {r.tokens_per_s:8.1f} tok/s ({r.seconds:.2f} s)", flush=True)
                if det not in best or r.tokens_per_s > best[det].tokens_per_s:
                    best[det] = r
        ratios[name] = best[True].tokens_per_s / best[False].tokens_per_s
        print(
            f"{name}: default {best[False].tokens_per_s:.1f} tok/s, deterministic {best[True].tokens_per_s:.1f} "
            f"tok/s, ratio {ratios[name]:.3f} (cost {100 * (1 - ratios[name]):.1f}%)",
            flush=True,
        )
    return ratios


if __name__ == "__main__":
    main()
