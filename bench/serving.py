"""Load test for a running server, modelled on SGLang's bench_serving: `python -m bench.serving`.

It builds a synthetic workload (bench/serving_datasets.py), sends it at a Poisson request rate
(exponential inter-arrival times with mean 1/rate; `inf` sends everything at once), optionally
under a concurrency cap, streams every reply through one of three clients (openai, native, ws:
bench/serving_backends.py) and reports throughput and TTFT / ITL / TPOT / E2E latency
(bench/serving_report.py): a table on stdout, and optionally a JSON file with every request and a
PNG plot.

Random lengths: a length L with range ratio r is drawn uniformly from the integers in
[max(1, floor(L * r)), L], both ends included (SGLang's convention). Prompts are random token ids
from the tokenizer's vocabulary (special tokens excluded), decoded to text; the prompt length
recorded is what that text re-encodes to.

Exit status: 0 when at least one request succeeded (failures are counted and their first
messages shown in the report), 1 when every request failed or the run could not start (server
unreachable, tokenizer not loadable), 2 for bad flags.

In-process use: `result = await run_benchmark(parse_args([...]))` returns a `BenchmarkResult`;
`main(argv)` is the command line (flags: bench/serving_cli.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from dataclasses import asdict
from typing import Any

import aiohttp
import numpy as np

from bench.serving_backends import Backend, RequestInput, StreamResult, make_backend
from bench.serving_cli import WARMUP_OUTPUT_LEN, dataset_spec, parse_args
from bench.serving_datasets import Conversation, RandomText, build_dataset
from bench.serving_report import BenchmarkResult, RequestRecord, compute_metrics, format_table, write_plot

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=6 * 3600, sock_connect=30)


class SetupError(Exception):
    """The benchmark cannot start (no model list, no tokenizer): reported in one line, exit 1."""


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds: the first at 0, then exponential gaps with mean 1/rate (all 0 for inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng([seed, 1])  # its own stream: the dataset's draws do not shift it
    gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> list[tuple[str, str]]:
    """(name, tokenizer path) of the served models: /v1/models, else SGLang's /get_model_info."""
    base = base_url.rstrip("/")
    try:
        async with session.get(base + "/v1/models", headers=headers) as r:
            if r.status == 200:
                data = (await r.json()).get("data") or []
                return [(m["id"], m.get("root") or m["id"]) for m in data if "id" in m]
        async with session.get(base + "/get_model_info", headers=headers) as r:
            if r.status == 200:
                info = await r.json()
                name = info.get("served_model_name") or info["model_path"]
                return [(name, info.get("tokenizer_path") or info["model_path"])]
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError) as e:
        raise SetupError(f"cannot list the models at {base_url}: {type(e).__name__}: {e}") from None
    raise SetupError(f"cannot list the models at {base_url}: /v1/models answered {r.status}")


async def flush_cache(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> None:
    try:
        async with session.post(base_url.rstrip("/") + "/flush_cache", headers=headers) as r:
            if r.status == 200:
                return
            message = f"answered {r.status}: {(await r.text())[:300]}"
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        message = f"{type(e).__name__}: {e}"
    raise SetupError(f"--flush-cache: /flush_cache {message}")


def load_tokenizer(name: str) -> Any:
    """Like the engine: the built-in model, a model folder or a .gguf (`engine.resolve_model`), else
    a Hugging Face tokenizer name or folder."""
    try:
        from engine import ModelLoadError, resolve_model
    except ImportError:
        pass
    else:
        with contextlib.suppress(ModelLoadError, OSError, ValueError):
            return resolve_model(name).load_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # OSError, ValueError, ... depending on what is missing
        raise SetupError(f"cannot load the tokenizer {name!r}: {e}") from None


# ---- the run ----------------------------------------------------------------------------------


def _count_prompt(tokenizer: Any, prompt: str | list[dict[str, str]]) -> int:
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    if getattr(tokenizer, "chat_template", None):
        return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
    return sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in prompt)


class _Run:
    """One benchmark run: sends every conversation at its arrival time and keeps the records."""

    def __init__(
        self,
        args: argparse.Namespace,
        backend: Backend,
        tokenizer: Any,
        model: str | None,
        conversations: list[Conversation],
    ) -> None:
        self.args, self.backend, self.tokenizer, self.model = args, backend, tokenizer, model
        self.conversations = conversations
        self.chat = args.backend == "openai" and args.dataset == "multi-turn"
        self.sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        self.records: list[RequestRecord] = []
        self.t0 = 0.0
        self.pbar: Any = None

    def _input(self, prompt: str | list[dict[str, str]], output_len: int) -> RequestInput:
        return RequestInput(prompt, output_len, self.model, self.args.ignore_eos, self.args.temperature)

    async def _send(self, req: RequestInput) -> StreamResult:
        async with self.sem or contextlib.nullcontext():
            start = time.perf_counter()
            try:
                return await self.backend.send(req)
            except Exception as e:  # a client-side surprise (odd response shape) fails this request only
                return StreamResult(start=start).fail(f"client-side error: {type(e).__name__}: {e}")

    async def warmup(self, n: int) -> list[str]:
        if n == 0 or not self.conversations:
            return []
        # A fresh random prompt as long as the first one: reusing a dataset prompt would leave it in
        # the server's prefix cache and flatter the first timed request.
        turn = self.conversations[0].turns[0]
        text, _ = RandomText(self.tokenizer).make(np.random.default_rng([self.args.seed, 2]), turn.target_len)
        prompt: Any = [{"role": "user", "content": text}] if self.chat else text
        outs = await asyncio.gather(
            *(self._send(self._input(prompt, min(turn.output_len, WARMUP_OUTPUT_LEN))) for _ in range(n))
        )
        return [o.error for o in outs if not o.success]

    def _record(
        self, index: int, conv_i: int, turn_i: int, prompt: Any, res: StreamResult | None, error: str = ""
    ) -> RequestRecord:
        conv = self.conversations[conv_i]
        turn = conv.turns[turn_i]
        rec = RequestRecord(
            index,
            conv_i,
            turn_i,
            conv.group,
            turn.target_len,
            turn.output_len,
            False,
            error,
            0,
            0,
            "server",
            None,
            0.0,
            0.0,
            0.0,
        )
        if res is None:
            return rec
        ms = 1000.0
        rec.success, rec.error = res.success, res.error
        rec.start_ms = (res.start - self.t0) * ms
        rec.e2e_ms = res.latency * ms
        if res.success:
            rec.ttft_ms = res.ttft * ms
            # Microsecond resolution is plenty and keeps the JSON of a long run small.
            rec.itl_ms = [round(x * ms, 3) for x in res.itl]
            rec.chunk_times_ms = [round((t - self.t0) * ms, 3) for t in res.chunk_times]
            rec.chunk_tokens = res.chunk_tokens
            rec.cached_tokens = res.cached_tokens
            if res.prompt_tokens is not None and res.completion_tokens is not None:
                rec.prompt_tokens, rec.output_tokens = res.prompt_tokens, res.completion_tokens
            else:
                rec.token_count_source = "tokenizer"
                rec.prompt_tokens = turn.prompt_len if turn_i == 0 else _count_prompt(self.tokenizer, prompt)
                rec.output_tokens = len(self.tokenizer.encode(res.text, add_special_tokens=False))
        return rec

    async def conversation(self, conv_i: int, first_index: int, offset: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + offset - time.perf_counter()))
        turns = self.conversations[conv_i].turns
        history_text = ""
        messages: list[dict[str, str]] = []
        for k, turn in enumerate(turns):
            if self.chat:
                messages.append({"role": "user", "content": turn.text})
                prompt: Any = list(messages)
            else:
                prompt = history_text + turn.text
            res = await self._send(self._input(prompt, turn.output_len))
            self.records.append(self._record(first_index + k, conv_i, k, prompt, res))
            self.pbar.update(1)
            if not res.success:
                for j in range(k + 1, len(turns)):
                    self.records.append(
                        self._record(
                            first_index + j, conv_i, j, None, None, f"not sent: turn {k} of this conversation failed"
                        )
                    )
                self.pbar.update(len(turns) - k - 1)
                return
            messages.append({"role": "assistant", "content": res.text})
            history_text = prompt + res.text if isinstance(prompt, str) else ""

    async def run(self) -> float:
        """Send everything; returns the duration (first send to last completion) in seconds."""
        from tqdm import tqdm

        total = sum(len(c.turns) for c in self.conversations)
        offsets = poisson_arrivals(len(self.conversations), self.args.request_rate, self.args.seed)
        firsts = np.cumsum([0] + [len(c.turns) for c in self.conversations]).tolist()
        self.pbar = tqdm(total=total, disable=self.args.disable_tqdm, desc="requests")
        try:
            self.t0 = time.perf_counter()
            await asyncio.gather(*(self.conversation(i, firsts[i], offsets[i]) for i in range(len(offsets))))
            duration = time.perf_counter() - self.t0
        finally:
            self.pbar.close()
        self.records.sort(key=lambda r: r.index)
        return duration


async def run_benchmark(
    args: argparse.Namespace, tokenizer: Any = None, conversations: list[Conversation] | None = None
) -> BenchmarkResult:
    """Run one benchmark as `args` (from `parse_args`) describes; writes --output-file / --plot.

    `tokenizer` and `conversations` may be given to skip loading / generating them (tests, or a
    caller that wants its own workload). Raises SetupError if the run cannot start.
    """
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on connections: no hidden queue
    # read_bufsize: SSE lines are read whole, and a native event repeats the whole text so far.
    async with aiohttp.ClientSession(timeout=HTTP_TIMEOUT, connector=connector, read_bufsize=2**22) as session:
        model, tok_name = args.model, args.tokenizer
        if (tokenizer is None and tok_name is None) or (model is None and args.backend == "openai"):
            served = await discover_model(session, args.base_url, headers)
            if not served:
                raise SetupError(f"{args.base_url} serves no models")
            match = [m for m in served if m[0] == model]
            model = model or served[0][0]
            tok_name = tok_name or (match or served)[0][1]
        if tokenizer is None:
            tokenizer = await asyncio.to_thread(load_tokenizer, tok_name)
        if conversations is None:
            conversations = await asyncio.to_thread(build_dataset, tokenizer, dataset_spec(args))
        backend = make_backend(args.backend, session, args.base_url, args.api_key)
        run = _Run(args, backend, tokenizer, model, conversations)
        try:
            warmup_errors = await run.warmup(args.warmup_requests)
            if args.flush_cache:
                await flush_cache(session, args.base_url, headers)
            duration = await run.run()
        finally:
            await backend.close()
    config = {
        "backend": args.backend,
        "base_url": args.base_url,
        "model": model,
        "tokenizer": tok_name,
        "dataset": args.dataset,
        "num_conversations": len(conversations),
        "num_requests": len(run.records),
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "warmup_requests": args.warmup_requests,
        "flush_cache": args.flush_cache,
        "dataset_spec": asdict(dataset_spec(args)),
    }
    result = BenchmarkResult(config, compute_metrics(run.records, duration), run.records, warmup_errors)
    if args.output_file:
        result.write_json(args.output_file)
    if args.plot:
        write_plot(result, args.plot)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        result = runner(run_benchmark(args))
    except SetupError as e:
        print(f"bench.serving: {e}", file=sys.stderr)
        return 1
    print(format_table(result))
    return 0 if result.metrics.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
