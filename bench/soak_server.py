"""`--launch` for the soak run: start `python -m server` as a subprocess on a free loopback port,
wait for /health, stop it with SIGTERM at the end.

The server writes to a log file rather than a pipe (a pipe nobody reads fills up and blocks it);
the soak run scans that log for tracebacks and shows its tail when the server dies or never
gets ready. Its pid lets the run read the server's RSS from /proc.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine import die_with_parent

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT = 300.0  # the default model's tokenizer alone takes ~15 s on a busy 2-core machine


class LaunchError(RuntimeError):
    """The server exited or never answered /health: the message has its log's tail."""


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float, name: str = "the server", log_tail: str | None = None
) -> None:
    """Poll `url`/health until it answers 200. LaunchError if `proc` exits first (its status and,
    from `log_tail()`-style text read then, its log) or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"{name} exited with status {proc.returncode} before it was ready{log_tail or ''}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"{name} was not ready within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m server` on a free loopback port (also the server tests' `ServerProcess`)."""

    def __init__(
        self, model_path: str, extra_args: list[str], log_path: Path | None = None, log_dir: Path | None = None
    ) -> None:
        """The server's output goes to `log_path`, else `server-<port>.log` in `log_dir`, else in a
        new temporary folder."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if log_path is None:
            folder = log_dir if log_dir is not None else Path(tempfile.mkdtemp(prefix="soak-"))
            log_path = folder / f"server-{self.port}.log"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "server", "--model-path", model_path, "--host", "127.0.0.1"]
        self.cmd += ["--port", str(self.port), *extra_args]
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = START_TIMEOUT) -> LaunchedServer:
        return self.launch().wait_ready(timeout)

    def launch(self) -> LaunchedServer:
        """Start the process; `wait_ready` then waits for /health."""
        if self._log is not None:  # a relaunch (same command, same port): the old handle is done
            self._log.close()
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - the server writes to it until stop()
        parent = os.getpid()
        self.proc = subprocess.Popen(
            self.cmd,
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: die_with_parent(parent),  # a killed soak or test run leaves no server behind
        )
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT) -> LaunchedServer:
        try:
            wait_healthy(self.url, self.proc, timeout)
        except LaunchError as e:
            self.stop()
            raise LaunchError(f"{e}:\n{self.log_tail()}") from None
        return self

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        """SIGTERM (the server drains and exits 0), a kill after 30 s; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode


def write_adapters(model_path: str, names: list[str], root: Path | None = None) -> list[str]:
    """Random rank-8 PEFT adapters of the model, one per name, in `root` (default: a new temporary
    folder); `--lora-paths` values."""
    from bench.lora_adapters import write_adapter
    from engine import resolve_model

    hf_config = resolve_model(model_path).hf_config
    root = root if root is not None else Path(tempfile.mkdtemp(prefix="soak-lora-"))
    for seed, name in enumerate(names):
        write_adapter(root / name, hf_config, rank=8, seed=seed)
    return [f"{name}={root / name}" for name in names]
