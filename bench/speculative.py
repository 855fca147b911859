"""Single-stream speed with n-gram speculative decoding vs without, same run, same outputs.

Each workload runs one request at a time through an in-process `Engine` with its defaults, once
plain and once with `speculative_algorithm="NGRAM"` (nothing else set). Greedy; the outputs must be
token-identical (printed as `same`), and the ratio is output tokens/s with speculation over
without. Acceptance = accepted draft tokens / drafted tokens (`get_internal_state()["speculative"]`).

    quote     the chat model asked to repeat a document (this repository's source) verbatim
    edit      asked to rewrite a function with one change (most of the answer quotes it)
    complete  a source file, then its first lines again: continue the file (EOS ignored)
    story     asked for a short story: free text, little to copy (the cost when drafts are rare)
    random    random token ids, EOS ignored (this small model falls into loops there, which the
              drafts then predict: not a worst case, shown because it is the usual "random" test)

Chat workloads stop at the model's end of turn. bf16 (the default here) is not batch-shape
invariant: a verify forward's numbers differ from a decode's in the last bits, so on a near-tie
the two runs may pick different tokens (`same` False); fp32 outputs are identical
(tests/test_speculative.py).

    python -m bench.speculative                          # every workload, 256 new tokens
    python -m bench.speculative --workloads quote random --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import uvloop

from engine import Engine, SamplingParams

WORKLOADS = ("quote", "edit", "complete", "story", "random")
IGNORE_EOS = ("complete", "random")
ROOT = Path(__file__).resolve().parent.parent
_VERIFY = (ROOT / "engine" / "speculative" / "verify.py").read_text()
DOC = _VERIFY[_VERIFY.index("def accept_drafts") :]  # one function, as text
FILE = (ROOT / "engine" / "speculative" / "ngram.py").read_text()[:1600]


@dataclass
class SpecResult:
    workload: str
    plain_tok_s: float
    spec_tok_s: float
    tokens: int
    same: bool
    accept_rate: float
    verify_steps: int

    @property
    def ratio(self) -> float:
        return self.spec_tok_s / self.plain_tok_s


def prompt_of(name: str, tokenizer, seed: int = 0) -> list[int]:
    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    if name == "quote":
        return chat("Repeat the following Python function exactly:\n\n```python\n" + DOC + "```")
    if name == "edit":
        return chat(
            "Rename the variable `start` to `offset` in this function. Show the whole function.\n\n```python\n"
            + DOC
            + "```"
        )
    if name == "story":
        return chat("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    if name == "complete":
        return tokenizer.encode(FILE + "\n\n# ---- the same module again ----\n" + FILE[:200])
    if name == "random":
        rng = random.Random(seed)
        return [rng.randrange(100, len(tokenizer)) for _ in range(200)]
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


async def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], float]:
    await engine.generate(prompts[0][:8], SamplingParams(temperature=0.0, max_new_tokens=4))  # warm up
    outputs, elapsed = [], 0.0
    for prompt in prompts:
        await engine.flush_cache()  # each run computes its prompt: no help from the previous one
        t0 = time.perf_counter()
        result = await engine.generate(prompt, params)
        elapsed += time.perf_counter() - t0
        outputs.append(result.token_ids)
    return outputs, elapsed


def run_workload(name: str, model: str, max_new_tokens: int) -> SpecResult:
    async def main() -> SpecResult:
        plain = Engine(model)
        spec = Engine(model, speculative_algorithm="NGRAM")
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=name in IGNORE_EOS)
        async with plain:
            prompts = [prompt_of(name, plain.tokenizer)]
            want, t_plain = await _run(plain, prompts, params)
        async with spec:
            got, t_spec = await _run(spec, prompts, params)
            stats = (await spec.get_internal_state())["speculative"]
        tokens = sum(map(len, got))
        return SpecResult(
            name,
            sum(map(len, want)) / t_plain,
            tokens / t_spec,
            tokens,
            got == want,
            stats["accept_rate"],
            stats["verify_steps"],
        )

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())


def main(argv: list[str] | None = None) -> list[SpecResult]:
    p = argparse.ArgumentParser(prog="python -m bench.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default="smollm2-135m")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--output-file")
    args = p.parse_args(argv)
    results = []
    print(f"{'workload':9} {'plain tok/s':>11} {'ngram tok/s':>11} {'ratio':>6} {'accept':>7} {'verifies':>8}  same")
    for name in args.workloads:
        r = run_workload(name, args.model_path, args.max_new_tokens)
        results.append(r)
        print(
            f"{r.workload:9} {r.plain_tok_s:11.1f} {r.spec_tok_s:11.1f} {r.ratio:5.2f}x {r.accept_rate:7.1%} "
            f"{r.verify_steps:8d}  {r.same}",
            flush=True,
        )
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump([asdict(r) | {"ratio": r.ratio} for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
