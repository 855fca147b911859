"""Shared by the data-parallel tests (test_dp.py, test_ray.py): a `python -m server --dp-size N`
controller in its own session, so that whatever it started (replicas, and anything they start)
is one process group the finaliser can kill even when the test failed halfway; an aiohttp app
served in process; polling with a timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from bench.soak_server import LaunchError, wait_healthy
from engine.child_process import die_with_parent
from tests.server_helpers import REPO, free_port, get_json, server_env

START_TIMEOUT = 180.0  # two replicas loading at once on a busy 2-core machine
CPU_ARGS = ("--dtype", "float32", "--device", "cpu", "--max-total-tokens", "4096", "--context-length", "2048")


class GroupProcess:
    """A command in a new session (process group); `stop` ends it and then the whole group."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log_path = cmd, log_path
        self.env = env or server_env()
        self.proc: subprocess.Popen | None = None

    def launch(self) -> GroupProcess:
        with open(self.log_path, "ab") as log:
            parent = os.getpid()
            self.proc = subprocess.Popen(
                self.cmd,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent),  # a killed test run leaves no server behind
            )
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; then SIGKILL to whatever is left in its process group."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


class DPServer(GroupProcess):
    """`python -m server --dp-size N ...` on a free loopback port; `start()` returns once the
    front end's /health answers 200 (the controller opens it only when every replica is ready)."""

    def __init__(self, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        # TMPDIR: the replica logs (and anything else the servers keep in temp) land in the test's dir
        super().__init__(cmd, log_dir / f"dp-{self.port}.log", {**server_env(), "TMPDIR": str(log_dir)})

    def start(self, timeout: float = START_TIMEOUT) -> DPServer:
        self.launch()
        assert self.proc is not None
        try:
            wait_healthy(self.url, self.proc, timeout, "the controller")
        except LaunchError as e:
            self.stop()  # the whole group: replicas a failed controller left behind too
            raise LaunchError(f"{e}:\n{self.log_tail()}") from None
        return self

    def dp(self) -> dict:
        return get_json(self.url + "/get_server_info")["dp"]


def run_controller(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `python -m server ARGS` to its end in its own process group (killed on timeout);
    (exit status, stdout, stderr)."""
    parent = os.getpid()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server", *args],
        cwd=REPO,
        env=env or server_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: die_with_parent(parent),
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running after {timeout:.0f} s:\n{err[-3000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def pid_alive(pid: int) -> bool:
    """A live process (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    """`app` served on a free loopback port, in this event loop; yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def poll(check, timeout: float = 20.0, every: float = 0.05):
    """Await `check()` until it returns something truthy; that value."""
    async with asyncio.timeout(timeout):
        while not (value := await check()):
            await asyncio.sleep(every)
    return value
