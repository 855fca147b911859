"""The Triton fused-MoE path (engine/layers/triton_moe.py) against `FusedMoE`'s torch experts.

Run by tests/test_moe_triton.py in a subprocess:

    TRITON_INTERPRET=1 python tests/moe_triton_checks.py                  # CPU, the interpreter
    python tests/moe_triton_checks.py --group compile                     # build for sm_90, no GPU
    python tests/moe_triton_checks.py --device cuda                       # a GPU, compiled

Shapes are tiny (the interpreter is slow) but cover what the kernel branches on: one token and a
batch whose busiest expert takes more than one row block, experts with no token, top-k 1 and 3,
renormalised or raw weights, Mixtral's fp32 routing weights, expert parallelism (half the experts
here, the other half's pairs skipped), fp32 and bf16; and the pair alignment itself. Seeded; the
last line is `ALL OK` when every check passed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from engine.distributed.parallel_state import TPGroup
from engine.layers.moe import FusedMoE
from tests.triton_subprocess import compile_for_gpu

FAILURES: list[str] = []
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # max |out - ref| / max |ref|; bf16: 40 seeds <= 1.5e-2


def report(ok: bool, label: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {label}", flush=True)
    if not ok:
        FAILURES.append(label)


def check_alignment() -> None:
    from engine.layers.triton_moe import align_pairs

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 8, (29, 3), generator=gen)
    for start, local in ((0, 8), (4, 4)):
        pairs, experts = align_pairs(ids, start, local, block_m=16)
        flat, seen, ok = ids.flatten(), [], True
        for b, e in enumerate(experts.tolist()):
            block = [p for p in pairs[b * 16 : (b + 1) * 16].tolist() if p < flat.numel()]
            ok &= e >= 0 or not block or all(not start <= flat[p] < start + local for p in block)
            if e >= 0:
                ok &= all(flat[p] == start + e for p in block)
                seen += block
        mine = sorted(p for p in range(flat.numel()) if start <= flat[p] < start + local)
        report(
            ok and sorted(seen) == mine, f"align experts [{start}, {start + local}): every pair once, blocks by expert"
        )


def check_experts(device: torch.device, dtype: torch.dtype) -> None:
    from engine.layers.triton_moe import fused_experts

    cases = {  # name -> (tokens, experts, top_k, renormalize, fp32_weights, expert sets)
        "decode-1-token": (1, 8, 2, True, False, 1),
        "batch-top3": (37, 8, 3, True, False, 1),
        "raw-top1": (20, 4, 1, False, False, 1),
        "mixtral-fp32-weights": (23, 8, 2, True, True, 1),
        "expert-parallel": (31, 8, 2, True, False, 2),
    }
    for seed, (name, (tokens, experts, top_k, renorm, fp32_w, sets)) in enumerate(cases.items()):
        torch.manual_seed(seed)  # not hash(name): str hashes change with every process
        args = (32, experts, top_k, 16, "silu", renorm, fp32_w, TPGroup.single(), device)  # hidden 32, inter 16
        whole = FusedMoE(*args, dtype)
        for p in whole.parameters():
            p.data.normal_(0, 0.5)
        x = torch.randn(tokens, 32, device=device).to(dtype)
        weights, ids = whole.route(x)
        # The reference is fp32 math on the same (bf16-valued) weights and inputs: measured against
        # the bf16 torch experts, the kernel's error would add theirs (each ~1e-2 from exact here).
        exact = FusedMoE(*args, torch.float32)
        exact.load_state_dict({k: v.float() for k, v in whole.state_dict().items()})
        ref = exact.experts(x.float(), weights.float(), ids)
        local = experts // sets
        got = torch.zeros_like(ref)
        for s in range(sets):  # each set's layer holds its experts only; their outputs add up
            part = slice(s * local, (s + 1) * local)
            got += fused_experts(x, whole.w13[part], whole.w2[part], weights, ids, whole.act_fn, s * local).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        report(err < TOL[dtype], f"experts {name} {str(dtype).removeprefix('torch.')}: rel err {err:.1e}")


def check_compile(arch: int = 90) -> None:
    """The kernel built for an H100 (`compile_for_gpu`), both GEMMs' constants, bf16 and fp32."""
    from engine.layers.triton_moe import moe_gemm_kernel

    ptr = {"SortedPairs": "i64", "BlockExpert": "i32", "Weights": "fp32", "A": "", "W": "", "C": ""}
    for dt in ("bf16", "fp32"):
        for by_token, mul in ((True, False), (False, True)):
            consts = dict(
                TOP_K=2, A_BY_TOKEN=by_token, MUL_WEIGHT=mul, UPCAST=False,
                DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=64,
            )  # fmt: skip
            sig = {
                a: "constexpr" if a in consts else "*" + (ptr[a] or dt) if a in ptr else "i32"
                for a in moe_gemm_kernel.arg_names
            }
            label = f"compile {'gate_up' if by_token else 'down'} {dt} sm_{arch}"
            error = compile_for_gpu(moe_gemm_kernel, sig, consts, arch)
            report(not error, f"{label}: {error}" if error else label)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--group", choices=("kernels", "compile"), default="kernels")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.group == "compile":
        check_compile()
    else:
        check_alignment()
        for dtype in (torch.float32, torch.bfloat16):
            check_experts(torch.device(args.device), dtype)
    if FAILURES:
        print("FAILED:", *FAILURES, sep="\n  ")
        return 1
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
