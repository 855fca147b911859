"""The Triton LoRA kernels (engine/lora/triton_ops.py) against the torch path of engine/lora/ops.py.

Run by tests/test_lora_triton.py in a subprocess:

    TRITON_INTERPRET=1 python tests/lora_triton_checks.py                 # CPU, the interpreter
    python tests/lora_triton_checks.py --group compile                    # build for sm_90, no GPU
    python tests/lora_triton_checks.py --device cuda                      # a GPU, compiled

Shapes are tiny (the interpreter is slow) but cover what the kernels branch on: gathered and
ungathered rows, a segment longer than one row block, ranks below the padded rank, parts of
different sizes, a slot that adapts nothing in a projection, fp32 and half types. Seeded; the last
line is `ALL OK` when every check passed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.lora import BASE_SLOT, LoRABatchInfo, LoRAPool, apply_lora
from engine.lora.projections import PROJECTIONS
from tests.lora_random import random_adapter, tiny_config
from tests.triton_subprocess import compile_for_gpu

FAILURES: list[str] = []
# max |out - ref| / max |ref|: the torch path rounds the delta to the dtype before adding it, the
# kernels add in fp32 and round once
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def check_kernels(device: torch.device, dtype: torch.dtype) -> None:
    cfg = tiny_config(num_layers=1, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2, head_dim=8)
    adapters = {
        "a": random_adapter(cfg, 8, seed=1, scaling=0.25),
        "b": random_adapter(cfg, 3, modules=("q_proj", "v_proj", "down_proj"), seed=2),
        "c": random_adapter(cfg, 5, modules=("k_proj", "up_proj"), seed=3),
    }
    pools = {}
    for kernel in ("torch", "triton"):
        pools[kernel] = LoRAPool(cfg, max_loras_per_batch=3, max_lora_rank=8, device=device, dtype=dtype, kernel=kernel)
        for name, adapter in adapters.items():
            pools[kernel].load(name, adapter)
    gen = torch.Generator().manual_seed(0)
    cases = {
        "mixed": (["a", None, "b", "a", "c", None], [3, 2, 17, 1, 2, 1]),
        "one adapter": (["c", "c"], [1, 2]),
    }
    for case, (names, rows) in cases.items():
        infos = {
            k: LoRABatchInfo.build(p, [BASE_SLOT if n is None else p.slot_of(n) for n in names], rows)
            for k, p in pools.items()
        }
        base_rows = torch.tensor([n is None for n, r in zip(names, rows) for _ in range(r)], device=device)
        for projection in PROJECTIONS:
            w = pools["torch"].weights(0, projection)
            x = torch.randn(sum(rows), w.a.shape[2], generator=gen).to(device, dtype)
            base = torch.randn(sum(rows), sum(w.out_sizes), generator=gen).to(device, dtype)
            ref = apply_lora(x, base.clone(), 0, projection, infos["torch"])
            out = apply_lora(x, base.clone(), 0, projection, infos["triton"])
            label = f"kernels {case} {projection} {str(dtype).removeprefix('torch.')}"
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            ok = torch.equal(out[base_rows], base[base_rows]) and err < TOL[dtype]
            print(f"{'ok  ' if ok else 'FAIL'} {label}: rel err {err:.1e} (tol {TOL[dtype]:.0e})", flush=True)
            if not ok:
                FAILURES.append(label)


def check_compile(arch: int = 90) -> None:
    """The interpreter never compiles: build both kernels for an H100 with Triton's own compiler
    and bundled ptxas (no GPU needed), so what only the compiler rejects shows up here."""
    from engine.lora import triton_ops as K

    ptr = {"RowIndex": "i64", "SegTable": "i32", "Scaling": "fp32", "H": "fp32", "PartTable": "i32"}
    for dt in ("bf16", "fp32"):
        common = dict(HAS_INDEX=True, UPCAST=False, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=16)
        kernels = [
            ("shrink", K.lora_shrink_kernel, dict(BLOCK_R=64, BLOCK_K=64, **common)),
            ("expand", K.lora_expand_kernel, dict(BLOCK_N=64, BLOCK_R=16, **common)),
        ]
        for name, fn, consts in kernels:
            sig = {
                a: "constexpr" if a in consts else "*" + ptr.get(a, dt) if a[0].isupper() else "i32"
                for a in fn.arg_names
            }
            label = f"compile {name} {dt} sm_{arch}"
            error = compile_for_gpu(fn, sig, consts, arch)
            ok, label = not error, f"{label}: {error}" if error else label
            print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
            if not ok:
                FAILURES.append(label)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--group", choices=("kernels", "compile"), default="kernels")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.group == "compile":
        check_compile()
    else:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            check_kernels(torch.device(args.device), dtype)
    if FAILURES:
        print("FAILED:", *FAILURES, sep="\n  ")
        return 1
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
