"""Runs inside vLLM's own virtual environment (bench/peer_vllm.py starts it): vLLM + stdlib only.

Reads workloads as JSON (`{"workloads": [{"name", "prompts": [[ids]], "output_lens": [n]}]}`,
written by bench.peer_vllm from bench.offline's workloads), starts one `vllm.LLM` on a Hugging
Face folder with vLLM's defaults (prefix caching on, bfloat16), warms it up as our engine is warmed
up (one 16-token prompt, 4 tokens), then runs every workload `--rounds` times: all its requests in
one `generate` call, greedy, EOS ignored, the prefix cache reset before each pass, each request's
output length checked. Writes the seconds of every pass as JSON to `--output`:

    {"vllm": "0.32.0", "threads": ..., "results": [{"workload", "output_tokens", "seconds": [...]}]}

Pass 1 is the first pass (what a user's first batch of that shape costs); the best of the later
passes is the steady state. vLLM spawns processes, hence the `__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

WARMUP_PROMPT = [100] * 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="vllm_driver.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face folder (config, tokenizer, safetensors)")
    ap.add_argument("--workloads", required=True, help="the workloads' JSON file")
    ap.add_argument("--output", required=True, help="where to write the results' JSON")
    ap.add_argument("--rounds", type=int, default=3, help="passes per workload (the first one is reported apart)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=None, help="vLLM's context limit (default: the model's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def read_workloads(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The workloads of the JSON file, each checked: a name, prompts of token ids, one length each."""
    data = json.loads(Path(path).read_text())
    out = []
    for wl in data["workloads"]:
        name, prompts, lens = str(wl["name"]), wl["prompts"], wl["output_lens"]
        if len(prompts) != len(lens) or not prompts:
            raise ValueError(f"workload {name}: {len(prompts)} prompts, {len(lens)} output lengths")
        if not all(p and all(isinstance(t, int) for t in p) for p in prompts):
            raise ValueError(f"workload {name}: every prompt must be a non-empty list of token ids")
        if not all(isinstance(n, int) and n > 0 for n in lens):
            raise ValueError(f"workload {name}: output lengths must be positive integers")
        out.append({"name": name, "prompts": prompts, "output_lens": lens})
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workloads = read_workloads(args.workloads)
    folder = Path(args.model)
    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    options: dict[str, Any] = {"dtype": args.dtype, "seed": args.seed}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if not has_tokenizer:  # a GGUF without a tokenizer (tests' tiny ones): ids in, ids out
        options["skip_tokenizer_init"] = True
    llm = LLM(model=str(folder), **options)
    greedy = {"temperature": 0.0, "ignore_eos": True, "detokenize": has_tokenizer}
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)], SamplingParams(max_tokens=4, **greedy), use_tqdm=False)
    results = []
    for wl in workloads:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in wl["prompts"]]
        params = [SamplingParams(max_tokens=n, **greedy) for n in wl["output_lens"]]
        seconds = []
        for _ in range(args.rounds):
            llm.reset_prefix_cache()  # every pass computes its prompts, as our engine after flush_cache
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            got = [len(o.outputs[0].token_ids) for o in outs]
            if got != wl["output_lens"]:
                bad = sum(g != n for g, n in zip(got, wl["output_lens"]))
                raise RuntimeError(f"{wl['name']}: {bad} requests did not produce their length ({sum(got)} tokens)")
        total = sum(wl["output_lens"])
        print(f"vllm {wl['name']}: " + ", ".join(f"{total / s:.1f}" for s in seconds) + " tok/s", flush=True)
        results.append({"workload": wl["name"], "output_tokens": total, "seconds": seconds})
    threads = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return {"vllm": vllm.__version__, "threads": threads, "results": results}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = run(args)
    Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
