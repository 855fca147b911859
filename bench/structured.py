"""Structured-output overhead: decode throughput of N concurrent JSON-schema requests against N
unconstrained requests of exactly the same prompts and output lengths, in one run.

Each round first runs the constrained requests (chat prompts asking for a record; each request
gets one of several schemas, sampled with a per-request seed), then the same prompts
unconstrained with `max_new_tokens` set to the length each constrained output had and EOS
ignored, so both sides decode the same number of tokens from the same batch shapes. Rounds
alternate and the best of each side is kept (this machine is noisy). Grammars are compiled
before timing (compile time is reported apart: it happens once per schema, off the scheduler).

Reported: output tokens/s end to end and over the decode phase (first decode step to the last),
their ratio (target >= 0.85), and the host time per constrained step spent filling the token
bitmasks (scheduler thread) and applying them to the logits (forward thread), from the
engine's own counters (`get_internal_state()["grammar_mask_*"]`).

    python -m bench.structured                       # 32 vs 32, default model, engine defaults
    python -m bench.structured --requests 64 --rounds 3 --output-file structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import uvloop

from engine import Engine, SamplingParams

SUBJECTS = ("a city", "a book", "a planet", "a river", "a scientist", "a recipe", "a car", "a song")
SCHEMAS: tuple[dict[str, Any], ...] = (
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        },
        "required": ["name", "country", "population", "landmarks"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
            "genre": {"enum": ["fiction", "science", "history", "poetry", "other"]},
            "rating": {"type": "number", "minimum": 0, "maximum": 5},
        },
        "required": ["title", "year", "genre", "rating"],
    },
    {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "maxLength": 120},
            "facts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"key": {"type": "string", "maxLength": 30}, "value": {"type": "string"}},
                    "required": ["key", "value"],
                },
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["summary", "facts"],
    },
)


@dataclass
class Side:
    name: str
    output_tokens: int
    seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


def _requests(n: int, max_tokens: int) -> list[tuple[list[dict[str, str]], SamplingParams]]:
    out = []
    for i in range(n):
        schema = SCHEMAS[i % len(SCHEMAS)]
        prompt = [
            {
                "role": "user",
                "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} (example {i}) as a JSON object with the "
                f"fields {', '.join(schema['properties'])}.",
            }
        ]
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.7, seed=i, json_schema=schema)
        out.append((prompt, params))
    return out


async def _timed(engine: Engine, name: str, reqs: list[tuple[Any, SamplingParams]]) -> tuple[Side, list[int]]:
    before = len(engine.recent_steps())
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, sp) for p, sp in reqs))
    seconds = time.perf_counter() - t0
    steps = engine.recent_steps()[before:]
    decode = [s for s in steps if s.mode == "DECODE"]
    decode_tokens = sum(s.batch_size for s in decode)
    decode_seconds = decode[-1].end - decode[0].start if decode else 0.0
    lens = [len(r.token_ids) for r in results]
    return Side(name, sum(lens), seconds, decode_tokens, decode_seconds), lens


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    async with Engine(args.model_path) as engine:
        reqs = _requests(args.requests, args.max_tokens)
        t0 = time.perf_counter()
        for schema in SCHEMAS:  # compile once, outside the timed runs
            await engine.generate("{", SamplingParams(max_new_tokens=1, json_schema=schema))
        compile_s = time.perf_counter() - t0
        await engine.generate("warm up", SamplingParams(max_new_tokens=4))
        best: dict[str, Side] = {}
        fill_s = apply_s = 0.0
        steps = 0
        for r in range(args.rounds):
            st0 = await engine.get_internal_state()
            constrained, lens = await _timed(engine, "json_schema", reqs)
            st1 = await engine.get_internal_state()
            steps += st1["grammar_steps"] - st0["grammar_steps"]
            fill_s += st1["grammar_mask_fill_s"] - st0["grammar_mask_fill_s"]
            apply_s += st1["grammar_mask_apply_s"] - st0["grammar_mask_apply_s"]
            plain_reqs = [
                (p, SamplingParams(max_new_tokens=max(1, n), temperature=0.7, seed=sp.seed, ignore_eos=True))
                for (p, sp), n in zip(reqs, lens)
            ]
            plain, plain_lens = await _timed(engine, "unconstrained", plain_reqs)
            assert plain_lens == [max(1, n) for n in lens], "the unconstrained side must decode the same lengths"
            for side in (constrained, plain):
                if side.name not in best or side.tok_s > best[side.name].tok_s:
                    best[side.name] = side
            print(
                f"round {r + 1}: json_schema {constrained.tok_s:7.1f} tok/s (decode {constrained.decode_tok_s:7.1f}), "
                f"unconstrained {plain.tok_s:7.1f} tok/s (decode {plain.decode_tok_s:7.1f})",
                flush=True,
            )
        cache = (await engine.get_internal_state())["grammar_cache"]
    c, u = best["json_schema"], best["unconstrained"]
    return {
        "requests": args.requests,
        "output_tokens": c.output_tokens,
        "json_schema": asdict(c) | {"tok_s": c.tok_s, "decode_tok_s": c.decode_tok_s},
        "unconstrained": asdict(u) | {"tok_s": u.tok_s, "decode_tok_s": u.decode_tok_s},
        "ratio": c.tok_s / u.tok_s,
        "decode_ratio": c.decode_tok_s / u.decode_tok_s if u.decode_tok_s else None,
        "mask_fill_ms_per_step": 1e3 * fill_s / steps if steps else None,
        "mask_apply_ms_per_step": 1e3 * apply_s / steps if steps else None,
        "constrained_steps": steps,
        "compile_s_first": compile_s,
        "grammar_cache": cache,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=32, help="concurrent requests on each side")
    ap.add_argument("--max-tokens", type=int, default=160, help="max_new_tokens of the constrained requests")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each side is kept")
    ap.add_argument("--output-file", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        res = runner.run(_run(args))
    c, u = res["json_schema"], res["unconstrained"]
    print(
        f"\n{res['requests']} concurrent requests, {res['output_tokens']} output tokens per side\n"
        f"  json_schema    {c['tok_s']:8.1f} tok/s   decode {c['decode_tok_s']:8.1f}\n"
        f"  unconstrained  {u['tok_s']:8.1f} tok/s   decode {u['decode_tok_s']:8.1f}\n"
        f"  ratio {res['ratio']:.3f} (decode {res['decode_ratio']:.3f}; target >= 0.85)\n"
        f"  mask fill {res['mask_fill_ms_per_step']:.3f} ms/step, apply {res['mask_apply_ms_per_step']:.3f} ms/step "
        f"over {res['constrained_steps']} constrained steps; first compiles {res['compile_s_first']:.2f} s"
    )
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
