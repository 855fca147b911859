"""Shared setup for the server tests: a tiny random Llama with the real SmolLM2 tokenizer, and
a real `python -m server` subprocess on a free loopback port.

The server runs in its own process (its own event loop, like production), so the sync openai
client and aiohttp clients in the tests talk to it over TCP exactly as users do. Its output goes
to a log file (a pipe nobody reads would fill up and block it); the tail is shown on failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bench.soak_server import LaunchedServer, free_port  # noqa: F401 (free_port: re-exported for the tests)
from tests.sched_harness import build_tiny_folder

REPO = Path(__file__).resolve().parent.parent
_tiny_cache: dict[str, str] = {}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_tokenizer) -> str:
    """Built once per test process, whichever module asks first."""
    if "dir" not in _tiny_cache:
        _tiny_cache["dir"] = build_tiny_folder(tmp_path_factory.mktemp("server-tiny"), default_tokenizer)
    return _tiny_cache["dir"]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


class ServerProcess(LaunchedServer):
    """`python -m server ...` on a free port, fp32 on one CPU thread; `start()` returns once
    /health answers 200 (`LaunchedServer` from bench.soak_server, with the tests' environment)."""

    def __init__(self, model: str, *args: str, log_dir: Path, dtype: str = "float32") -> None:
        super().__init__(model, ["--dtype", dtype, "--torch-threads", "1", "--device", "cpu", *args], log_dir=log_dir)
        self.env = server_env()


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> dict:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


async def wait_clean(session, url: str, headers: dict[str, str] | None = None, timeout: float = 60) -> dict:
    """Once idle, the engine's memory invariant must hold: every KV slot free or evictable."""
    async with asyncio.timeout(timeout):
        while True:
            async with session.get(url + "/get_server_info", headers=headers) as r:
                assert r.status == 200, await r.text()
                st = (await r.json())["internal_states"][0]
            if st["running_requests"] == 0 and st["waiting_requests"] == 0 and st["protected_tokens"] == 0:
                break
            await asyncio.sleep(0.02)
    assert st["available_tokens"] + st["evictable_tokens"] == st["total_tokens"], st
    assert st["protected_tokens"] == 0, st
    assert st["memory_errors"] == [], st["memory_errors"]
    return st


_shared: dict[str, ServerProcess] = {}


def shared_server(request, key: str, model: str, *args: str) -> ServerProcess:
    """One server per `key` for the whole test process, whichever module asks first; stopped at
    session end. (A fixture imported into several modules would start one per module.)"""
    if key not in _shared:
        log_dir = request.config._tmp_path_factory.mktemp("server-logs")  # type: ignore[attr-defined]
        srv = ServerProcess(model, *args, log_dir=log_dir)
        request.config.add_cleanup(srv.stop)
        _shared[key] = srv.start()
    srv = _shared[key]
    if srv.proc.poll() is not None:
        raise RuntimeError(f"shared server {key} died:\n{srv.log_tail()}")
    return srv


TINY_ARGS = ("--max-total-tokens", "16384", "--max-running-requests", "32")


@pytest.fixture
def tiny_server(request, tiny_model_dir) -> ServerProcess:
    """The tiny model behind a server with metrics on: native, WebSocket and metrics tests."""
    return shared_server(request, "tiny-metrics", tiny_model_dir, *TINY_ARGS, "--enable-metrics")
