"""Offline throughput: the same workload through our `Engine` and through transformers, one run.

Same weights, dtype, thread count and machine for both sides; every request is greedy with EOS
ignored, so each produces exactly its requested number of tokens and only those are counted.
Prints output tokens/s of each method and our ratio to the best transformers method, and to
each peer engine asked for with `--peers`.

Workloads (token ids drawn with `--seed`, default 0, from the model's vocabulary):

    W1 mixed          64 requests, prompt length U[64, 512], output length U[32, 256]
    W2 shared-prefix  8 groups x 8: one 512-token prefix per group + a 64-token question, 64 out
    W3 decode-heavy   32 requests, 32-token prompts, 256 output tokens
    single            1 request, 32-token prompt, 128 output tokens (single-stream speed)
    single200         1 request, 200-token prompt, 256 output tokens (single stream, end to end)
    M0..M5            the mixed-shape family (`--workloads family`): M0 is 32 requests, prompts
                      U[64, 384], outputs U[32, 160] (fewer requests, shorter outputs than W1);
                      M1..M5 draw a request count from 16-128 and prompt/output ranges from
                      their own seeds (`family_shape`), so no shape is chosen to flatter us

transformers methods (the baselines a user already has):

    static    `generate` with left padding on the whole workload as one batch
    static16  `generate` on sub-batches of 16 requests sorted by prompt length (less padding)
    cb        transformers' continuous batching (`init_continuous_batching`, per-request lengths)

W2 also runs our engine with the radix cache disabled (`ours-noradix`), the prefix-reuse ratio.

Peers (`--peers`, the engines a user would pick instead; same prompt ids, greedy, EOS ignored):

    vllm      vLLM's CPU backend (bench/peer_vllm.py), in its own venv, installed on first use; a
              GGUF is dequantized into a bf16 Hugging Face folder for it. Two rows: `vllm` is its
              first pass of the workload, `vllm-steady` the best of passes 2..`--peer-rounds`
    llama     llama.cpp's `llama-server` (bench/peer.py; `--llama-server PATH`, a GGUF model)

    python -m bench.offline                                 # everything (several minutes)
    python -m bench.offline --workloads W3 single --hf-methods static
    python -m bench.offline --workloads family --hf-methods static16 cb   # the mixed family
    python -m bench.offline --output-file offline.json
    python -m bench.offline --workloads W3 --hf-methods --peers vllm llama --llama-server ./llama-server
    python -m bench.offline --workloads M2 --rounds 3 --peers vllm      # first pass and steady state, both sides
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from bench.peer import run_peer
from bench.peer_vllm import VllmEnvError, ensure_vllm_env, hf_folder_for, run_vllm
from bench.workloads import FAMILY, Result, Workload, family_shape, make_workload, run_ours, run_ours_passes
from engine import ModelSource, default_torch_threads, resolve_model

HF_METHODS = ("static", "static16", "cb")
PEERS = ("vllm", "llama")


# ---- transformers ---------------------------------------------------------------------------


def load_hf(source: ModelSource, dtype: torch.dtype, dense: bool = True):
    """transformers' model on the same weights.

    `dense` (the default): the GGUF's tensors dequantized once, by the same reader our engine uses,
    into a plain transformers model of the GGUF's config: dense `dtype` matmuls, transformers'
    fastest path. Otherwise transformers' own GGUF loading, which (in transformers 5.x) keeps the
    weights packed and dequantizes them in every matmul, computing in float32: slower on this CPU,
    so it would flatter us as a baseline.
    """
    from transformers import AutoModelForCausalLM

    if source.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).eval()
    if not dense:
        path = source.gguf_file
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(source.iter_weights()), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"GGUF -> transformers state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    return model.eval()


@torch.inference_mode()
def _hf_static_batch(model, prompts: list[list[int]], output_lens: list[int], pad_id: int) -> None:
    """One left-padded `generate` call running to the longest requested length in the batch."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    n = max(output_lens)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
    )
    assert out.shape[1] == width + n


def run_hf_static(model, wl: Workload, sub_batch: int | None, pad_id: int) -> Result:
    order = list(range(len(wl.prompts)))
    if sub_batch:
        order.sort(key=lambda i: len(wl.prompts[i]))
    size = sub_batch or len(order)
    _hf_static_batch(model, [wl.prompts[0][:16]], [2], pad_id)  # warm-up
    t0 = time.perf_counter()
    for s in range(0, len(order), size):
        part = order[s : s + size]
        _hf_static_batch(model, [wl.prompts[i] for i in part], [wl.output_lens[i] for i in part], pad_id)
    elapsed = time.perf_counter() - t0
    # Tokens generated past a request's own length (to finish its batch) are not counted.
    return Result(wl.name, f"hf-static{sub_batch or ''}", elapsed, wl.output_tokens)


@torch.inference_mode()
def run_hf_cb(model, wl: Workload) -> Result:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        tokens, done = 0, 0
        while done < len(wl.prompts):
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers continuous batching returned no result within 600 s")
            if out.is_finished():
                done += 1
                tokens += len(out.generated_tokens)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return Result(wl.name, "hf-cb", elapsed, tokens)


# ---- driver ---------------------------------------------------------------------------------


def _report(results: list[Result]) -> str:
    lines = [f"{'workload':>8} {'method':>14} {'seconds':>9} {'out tok':>8} {'tok/s':>9} {'ours/x':>7}"]
    by_wl: dict[str, list[Result]] = {}
    for r in results:
        by_wl.setdefault(r.workload, []).append(r)
    for name, rs in by_wl.items():
        ours = next((r for r in rs if r.method == "ours"), None)
        steady = next((r for r in rs if r.method == "ours-steady"), None)
        for r in rs:
            # a peer's steady state against ours (first passes against first passes)
            mine = steady if steady is not None and r.method.endswith("-steady") else ours
            ratio = f"{mine.tokens_per_s / r.tokens_per_s:>7.2f}" if mine and r is not mine else f"{'':>7}"
            lines.append(
                f"{name:>8} {r.method:>14} {r.seconds:>9.2f} {r.output_tokens:>8} {r.tokens_per_s:>9.1f} {ratio}"
            )
        hf = [r for r in rs if r.method.startswith("hf-")]
        if ours and hf:
            best = max(hf, key=lambda r: r.tokens_per_s)
            lines.append(
                f"{name:>8} ours / best transformers ({best.method}): {ours.tokens_per_s / best.tokens_per_s:.2f}x"
            )
    return "\n".join(lines)


def check_peers(args: argparse.Namespace, source: ModelSource) -> Path | None:
    """Each peer asked for is runnable (the vLLM env installed unless --no-vllm-install, the GGUF
    dequantized for it, llama-server's binary and GGUF present); vLLM's python, or None."""
    if "llama" in args.peers:
        if source.gguf_file is None:
            raise SystemExit("--peers llama needs a GGUF model (--model-path FILE.gguf or the default)")
        if not os.access(args.llama_server, os.X_OK):
            raise SystemExit(f"--llama-server {args.llama_server}: not an executable file")
    if "vllm" not in args.peers:
        return None
    try:
        python = ensure_vllm_env(args.vllm_venv, install=not args.no_vllm_install)
    except VllmEnvError as e:
        raise SystemExit(f"--peers vllm: {e}") from None
    hf_folder_for(args.model_path)
    return python


def main(argv: list[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both sides' forward (default: ours as Engine() picks them, transformers the same)",
    )
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["W1", "W2", "W3", "single"],
        help="W1 W2 W3 single, M0..M5, or family (= M0..M5)",
    )
    ap.add_argument("--hf-methods", nargs="*", default=list(HF_METHODS), choices=HF_METHODS)
    ap.add_argument("--no-radix-compare", action="store_true", help="skip ours without the radix cache on W2")
    ap.add_argument("--disable-cascade-attention", action="store_true", help="ours: no shared-prefix decode attention")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="our KV pool size (default: from memory)")
    ap.add_argument(
        "--torchao-config",
        default="",
        help="ours: weight-only quantization of an HF checkpoint as it loads (int8wo, int4wo-128, ...)",
    )
    ap.add_argument(
        "--q4-int8-activations",
        action="store_true",
        help="ours: the server's --q4-int8-activations (4-bit loops read x in int8 blocks; off by default)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="ours: passes per workload in one engine; above 1 also prints ours-steady, the best later pass",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-file", default=None, help="write the results as JSON")
    ap.add_argument("--peers", nargs="*", default=[], choices=PEERS, help="also run these engines")
    ap.add_argument("--llama-server", metavar="PATH", help="the llama-server binary (--peers llama)")
    ap.add_argument("--llama-port", type=int, default=30411, help="where llama-server listens")
    ap.add_argument("--peer-rounds", type=int, default=3, help="vLLM's passes per workload (first + steady)")
    ap.add_argument("--vllm-venv", metavar="PATH", help="vLLM's venv (default $ASYNCLLM_VLLM_VENV or /tmp/vllmenv)")
    ap.add_argument("--no-vllm-install", action="store_true", help="fail instead of installing a missing vLLM")
    args = ap.parse_args(argv)
    if "llama" in args.peers and not args.llama_server:
        ap.error("--peers llama needs --llama-server PATH")

    # Ours runs with the engine's defaults (it sets its event-loop thread's torch threads itself);
    # transformers runs on this thread with the same thread count as our forward.
    hf_threads = args.threads if args.threads is not None else default_torch_threads()
    source = resolve_model(args.model_path)
    vocab = source.hf_config.vocab_size
    dtype = getattr(torch, args.dtype)
    print(f"model={args.model_path} dtype={args.dtype} threads={hf_threads} torch={torch.__version__} seed={args.seed}")
    names = [m for w in args.workloads for m in (FAMILY if w == "family" else (w,))]
    for m in names:
        if m in FAMILY:
            n, prompt, output = family_shape(FAMILY.index(m))
            print(f"  {m}: {n} requests, prompts U{list(prompt)}, outputs U{list(output)}")
    workloads = [make_workload(w, vocab, args.seed) for w in names]
    vllm_python = check_peers(args, source)  # a missing peer fails here, before minutes of runs
    results: list[Result] = []

    def keep(r: Result) -> None:
        results.append(r)
        print(f"  {r.workload:>8} {r.method:>14}: {r.tokens_per_s:8.1f} tok/s ({r.seconds:.2f} s)", flush=True)

    def record(run: Callable[..., Result], *run_args: Any, **run_kw: Any) -> None:
        keep(run(*run_args, **run_kw))

    quant = {"torchao_config": args.torchao_config} if args.torchao_config else {}
    if args.q4_int8_activations:
        quant["q4_int8_activations"] = True
    for wl in workloads:
        for r in run_ours_passes(wl, args, args.rounds, **quant):
            keep(r)
        if wl.name == "W2" and not args.no_radix_compare:
            record(run_ours, wl, args, disable_radix=True, **quant)
    if args.hf_methods:
        model = load_hf(source, dtype)
        pad_id = source.hf_config.eos_token_id if isinstance(source.hf_config.eos_token_id, int) else 0
        torch.set_num_threads(hf_threads)
        for wl in workloads:
            for m in args.hf_methods:
                if m == "static16" and len(wl.prompts) <= 16:
                    continue  # identical to "static"
                if m == "cb":
                    record(run_hf_cb, model, wl)
                else:
                    record(run_hf_static, model, wl, 16 if m == "static16" else None, pad_id)
        del model
    if "llama" in args.peers:
        for wl in workloads:
            record(run_peer, args.llama_server, source.gguf_file, wl, hf_threads, args.llama_port)
    if vllm_python is not None:
        for r in run_vllm(args.model_path, workloads, args.peer_rounds, hf_threads, vllm_python, args.dtype, args.seed):
            keep(r)
    print(_report(results))
    if any(r.method == "vllm-steady" for r in results):
        print(f"vllm: its first pass of each workload; vllm-steady: its best of passes 2..{args.peer_rounds}")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(
                {"args": vars(args), "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results]},
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
