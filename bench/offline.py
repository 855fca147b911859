"""Offline throughput: the same workload through our `Engine` and through transformers, one run.

Same weights, dtype, thread count and machine for both sides; every request is greedy with EOS
ignored, so each produces exactly its requested number of tokens and only those are counted.
Prints output tokens/s of each method and our ratio to the best transformers method.

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

    python -m bench.offline                                 # everything (several minutes)
    python -m bench.offline --workloads W3 single --hf-methods static
    python -m bench.offline --workloads family --hf-methods static16 cb   # the mixed family
    python -m bench.offline --output-file offline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import uvloop

from engine import Engine, ModelSource, SamplingParams, default_torch_threads, resolve_model

HF_METHODS = ("static", "static16", "cb")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Skip the first ids: SmolLM2 keeps its special tokens there.
    return [rng.randrange(100, vocab) for _ in range(n)]


FAMILY = tuple(f"M{i}" for i in range(6))


def family_shape(index: int) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Member `index` of the mixed family: (requests, prompt length range, output length range).
    M0 is the shape a user tried; the others come from their own seeds, fixed across runs."""
    if index == 0:
        return 32, (64, 384), (32, 160)
    rng = random.Random(1000 + index)
    prompt_lo, output_lo = rng.choice((16, 32, 64, 128)), rng.choice((8, 16, 32, 64))
    prompt = (prompt_lo, prompt_lo * rng.choice((2, 4, 8)))
    output = (output_lo, output_lo * rng.choice((2, 4, 8)))
    return rng.choice((16, 32, 64, 128)), prompt, output


def make_workload(name: str, vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name in FAMILY:
        n, (p_lo, p_hi), (o_lo, o_hi) = family_shape(FAMILY.index(name))
        prompts = [_ids(rng, rng.randint(p_lo, p_hi), vocab) for _ in range(n)]
        return Workload(name, prompts, [rng.randint(o_lo, o_hi) for _ in range(n)])
    if name == "W1":
        prompts = [_ids(rng, rng.randint(64, 512), vocab) for _ in range(64)]
        return Workload(name, prompts, [rng.randint(32, 256) for _ in range(64)])
    if name == "W2":
        prompts = []
        for _ in range(8):
            prefix = _ids(rng, 512, vocab)
            prompts += [prefix + _ids(rng, 64, vocab) for _ in range(8)]
        return Workload(name, prompts, [64] * len(prompts))
    if name == "W3":
        return Workload(name, [_ids(rng, 32, vocab) for _ in range(32)], [256] * 32)
    if name == "single":
        return Workload(name, [_ids(rng, 32, vocab)], [128])
    if name == "single200":  # issue 17's end-to-end single-stream shape (200-token prompt, 256 out)
        return Workload(name, [_ids(rng, 200, vocab)], [256])
    raise ValueError(f"unknown workload {name!r}; choose from W1 W2 W3 single single200")


@dataclass
class Result:
    workload: str
    method: str
    seconds: float
    output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- ours -----------------------------------------------------------------------------------


def run_ours(wl: Workload, args: argparse.Namespace, disable_radix: bool = False, **options: Any) -> Result:
    """Our engine on `wl`, with the engine's defaults plus `options` (a benchmark comparing one
    option on and off, e.g. bench.flight_recorder)."""
    engine = Engine(
        args.model_path,
        dtype=args.dtype,
        device="cpu",
        torch_threads=args.threads,  # None unless --threads: the engine's default, as a user gets it
        max_running_requests=max(len(wl.prompts), 1),
        disable_radix_cache=disable_radix,
        max_total_tokens=args.max_total_tokens,
        disable_cascade_attention=args.disable_cascade_attention,
        **options,
    )

    async def main() -> tuple[float, int, int]:
        async with engine:
            warm = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
            await engine.generate(wl.prompts[0][:16], warm)  # first-call costs are not throughput
            await engine.flush_cache()
            params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in wl.output_lens]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(wl.prompts, params)))
            elapsed = time.perf_counter() - t0
        bad = [r for r, n in zip(results, wl.output_lens) if r.completion_tokens != n]
        if bad:
            raise RuntimeError(f"{len(bad)} requests did not produce their length, e.g. {bad[0]!r}")
        return elapsed, sum(r.completion_tokens for r in results), sum(r.cached_tokens for r in results)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        elapsed, tokens, cached = runner.run(main())
    name = "ours-noradix" if disable_radix else "ours"
    return Result(wl.name, name, elapsed, tokens, {"cached_prompt_tokens": cached})


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
        for r in rs:
            ratio = f"{ours.tokens_per_s / r.tokens_per_s:>7.2f}" if ours and r is not ours else f"{'':>7}"
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-file", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

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
    results: list[Result] = []

    def record(run: Callable[..., Result], *run_args: Any, **run_kw: Any) -> None:
        r = run(*run_args, **run_kw)
        results.append(r)
        print(f"  {r.workload:>8} {r.method:>14}: {r.tokens_per_s:8.1f} tok/s ({r.seconds:.2f} s)", flush=True)

    for wl in workloads:
        record(run_ours, wl, args)
        if wl.name == "W2" and not args.no_radix_compare:
            record(run_ours, wl, args, disable_radix=True)
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
    print(_report(results))
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
