"""One replica server process on this host: `python -m server ...` with its output in a log file.

Used by both placements: the local controller runs one per replica, and under Ray each replica
actor runs one on its node. Why a log file per replica (rather than the controller's stderr with
a prefix): a pipe needs a reader that never falls behind, or a chatty replica blocks on a full
pipe; a file needs nothing, survives the controller, and its tail is what the controller prints
when a replica fails to start. A restart appends to the same file after a marker line.

Why `die_with_parent` (engine/child_process.py, Linux `PR_SET_PDEATHSIG`): if the process that
started the replica dies without stopping it (the controller or a Ray actor killed with SIGKILL),
the kernel sends the replica SIGTERM, so it drains and exits instead of holding its port and memory
forever. The signal follows the thread that forked the child: both users fork from their
event-loop thread, which lives as long as they do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from engine import die_with_parent

POLL_S = 0.2  # readiness poll interval
MARKER = "=== asyncllm dp: launch"


class ReplicaStartError(RuntimeError):
    """A replica exited, or never answered /health, during start-up."""

    def __init__(self, index: int, reason: str, error_line: str | None, log_tail: str, status: int | None) -> None:
        super().__init__(f"replica {index} {reason}" + (f": {error_line}" if error_line else ""))
        self.index, self.reason, self.status = index, reason, status
        self.error_line, self.log_tail = error_line, log_tail


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m server ARGS` with cwd and environment inherited (plus `env`), output to `log_path`."""

    def __init__(self, index: int, log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.index = index
        self.log_path = log_path
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.log_offset = 0  # where the current launch's output starts in the log
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self, args: Sequence[str], url: str) -> None:
        """Start the process (returns at once; `wait_ready` waits for it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            log.write(f"{MARKER} {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(args)}\n".encode())
            log.flush()
            parent = os.getpid()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
                preexec_fn=lambda: die_with_parent(parent),  # see the module doc
            )
        self.url = url
        self.started_at = time.monotonic()

    async def wait_ready(self, timeout: float) -> None:
        """Return once GET /health answers 200; `ReplicaStartError` if the process exits first
        or the timeout passes (the process is then killed)."""
        assert self.proc is not None and self.url is not None
        deadline = time.monotonic() + timeout
        probe = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=probe) as session:
            while True:
                status = self.proc.poll()
                if status is not None:
                    raise self.start_error(f"exited with status {status} during start-up", status)
                try:
                    async with session.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise self.start_error(f"did not answer /health within {timeout:g}s", None)
                await asyncio.sleep(POLL_S)

    def start_error(self, reason: str, status: int | None) -> ReplicaStartError:
        return ReplicaStartError(self.index, reason, self.error_line(), self.log_tail(), status)

    async def wait_exit(self) -> int:
        """The exit status, once the process ends: a pidfd watched by the event loop (Linux),
        else polling; never a thread per replica."""
        assert self.proc is not None
        proc = self.proc
        fd = None
        if hasattr(os, "pidfd_open") and proc.returncode is None:
            with contextlib.suppress(OSError):  # already reaped, or no pidfd support
                fd = os.pidfd_open(proc.pid)
        if fd is not None:
            loop = asyncio.get_running_loop()
            exited = loop.create_future()
            loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
            try:
                await exited
            finally:
                loop.remove_reader(fd)
                os.close(fd)
            return proc.wait()
        while proc.poll() is None:
            await asyncio.sleep(POLL_S)
        return proc.returncode

    def kill(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM (the server drains and exits 0), SIGKILL after `timeout`; the exit status."""
        if self.proc is None:
            return None
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait_exit(), timeout)
            except TimeoutError:
                self.kill()
        return self.proc.returncode

    def log_text(self) -> str:
        """This launch's output so far."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_text().rstrip().splitlines()[-lines:])

    def error_line(self) -> str | None:
        """The server's own one-line start-up error (`error: ...`), if it printed one."""
        found = [ln for ln in self.log_text().splitlines() if ln.startswith("error:")]
        return found[-1].removeprefix("error:").strip() if found else None


__all__ = ["MARKER", "ReplicaStartError", "ServerProcess", "free_port"]
