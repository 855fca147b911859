"""Greedy parity with transformers on one device, every attention path (bench/gpu_check.sh runs it on CUDA):

    python -m bench.gpu_parity --device cuda --json parity.json
    python -m bench.gpu_parity --device cpu --prompts 1 --new-tokens 2 --dtypes float32   # `--dry-run`

fp32: our greedy tokens must equal transformers' `generate` (same GGUF, same device, one prompt at a
time) for every variant: on CUDA the Triton backend with decode CUDA graphs, the Triton backend eager
(so graph replay is also checked against eager) and the torch backend; on a CPU the default backend.
The prompts (bench/parity_prompts.py) run as one continuous batch: half start, a few steps later the
rest join, so the batch mixes prefill lengths and decode progress (as tests/test_greedy_default_model.py
does on CPU).

bf16: greedy is not bit-reproducible across kernels, so each of our tokens is checked teacher-forced
against transformers bf16 on the same sequence: at most `BF16_MAX_GAP` below its best logit, and
transformers' argmax for at least `BF16_MIN_AGREE` of the tokens.

Exit status 0 when every check holds, 1 otherwise (the JSON says which prompt diverged where).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.parity_prompts import parity_prompts

BF16_MAX_GAP = 0.5  # a bf16 logit near 20 is resolved to ~0.06-0.125: a real near-tie, not a wrong kernel
BF16_MIN_AGREE = 0.97


def hf_model(source: Any, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    path = source.gguf_file
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    return model.to(device).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' `generate`, one prompt at a time (stopping at EOS as it does)."""
    device = next(model.parameters()).device
    outs = []
    for ids in prompts:
        inp = torch.tensor([ids], device=device)
        gen = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=new_tokens)
        outs.append(gen[0, len(ids) :].tolist())
    return outs


def ours_greedy(model: str, prompts: list[list[int]], new_tokens: int, **options: Any) -> list[list[int]]:
    """Our scheduler + runner, the prompts as one continuous batch (half join a few steps late)."""
    from engine import SamplingParams, ServerArgs, SyncScheduler

    args = ServerArgs(model_path=model, max_total_tokens=16384, max_running_requests=32, **options)
    sched = SyncScheduler.from_args(args)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    first = [sched.add_request(p, params) for p in prompts[::2]]
    for _ in range(5):
        sched.step()
    second = [sched.add_request(p, params) for p in prompts[1::2]]
    sched.run_until_idle()
    reqs: list[Any] = [None] * len(prompts)
    reqs[::2], reqs[1::2] = first, second
    sched.scheduler.check_memory()
    return [list(r.output_ids) for r in reqs]


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a length difference counts), or None."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(ours: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    diffs = [(i, first_diff(o, r)) for i, (o, r) in enumerate(zip(ours, ref))]
    bad = [{"prompt": i, "token": d} for i, d in diffs if d is not None]
    return {"identical": not bad, "tokens": sum(map(len, ours)), "diverged": bad}


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompts: list[list[int]], outs: list[list[int]]) -> dict[str, Any]:
    """How far below transformers' best logit each of our tokens is, on our own sequence (the bf16
    bar of this script and of the CPU tests): ok, the worst gap and where (prompt, token), and how
    many tokens are transformers' argmax."""
    device = next(model.parameters()).device
    agree = total = 0
    worst, worst_at = 0.0, None
    for i, (p, out) in enumerate(zip(prompts, outs)):
        if not out:
            continue
        ours = torch.tensor(list(out), device=device)
        seq = torch.tensor([list(p) + list(out)], device=device)
        logits = model(seq).logits[0, len(p) - 1 : len(p) - 1 + len(out)].float()
        gap = logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]
        if float(gap.max()) > worst:
            worst, worst_at = float(gap.max()), [i, int(gap.argmax())]
        agree += int((gap == 0).sum())
        total += len(out)
    ok = worst <= BF16_MAX_GAP and agree >= BF16_MIN_AGREE * total
    return {"ok": ok, "max_gap": worst, "worst_at": worst_at, "argmax_agree": agree, "tokens": total}


def variants(device: str) -> dict[str, dict[str, Any]]:
    if device == "cuda":
        return {
            "triton+graphs": {"attention_backend": "triton"},
            "triton eager": {"attention_backend": "triton", "disable_cuda_graph": True},
            "torch": {"attention_backend": "torch"},
        }
    return {"default": {}}


def run(model: str, device: str, n_prompts: int, new_tokens: int, dtypes: list[str]) -> dict[str, Any]:
    from engine import resolve_model

    source = resolve_model(model)
    prompts = parity_prompts(source.load_tokenizer())[:n_prompts]
    report: dict[str, Any] = {"device": device, "prompts": len(prompts), "new_tokens": new_tokens}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    ok = True
    if "float32" in dtypes:
        hf = hf_model(source, torch.float32, device)
        ref = hf_greedy(hf, prompts, new_tokens)
        del hf
        report["fp32"] = {}
        for name, opts in variants(device).items():
            t0 = time.perf_counter()
            outs = ours_greedy(model, prompts, new_tokens, device=device, dtype="float32", **opts)
            report["fp32"][name] = {**compare(outs, ref), "seconds": round(time.perf_counter() - t0, 1)}
            ok &= report["fp32"][name]["identical"]
            print(f"fp32 {name}: {report['fp32'][name]}", flush=True)
    if "bfloat16" in dtypes:
        outs = ours_greedy(model, prompts, new_tokens, device=device, dtype="bfloat16")
        hf = hf_model(source, torch.bfloat16, device)
        report["bf16"] = teacher_forced(hf, prompts, outs)
        ok &= report["bf16"]["ok"]
        print(f"bf16 default: {report['bf16']}", flush=True)
    report["ok"] = ok
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_parity", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=12, help="how many of the twelve parity prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_parity --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    report = run(args.model, args.device, args.prompts, args.new_tokens, args.dtypes)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    print("parity", "OK" if report["ok"] else "FAILED", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
