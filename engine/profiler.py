"""torch.profiler around the engine's forwards, started and stopped at run time (SGLang's
/start_profile and /stop_profile; issue 18, item 3).

The profiler is started and stopped *on the device stream* (`DeviceStream.launch`): on a CPU
that is the forward thread, so its ops are recorded whatever torch's profiler does with other
threads, and the start lands between two forwards, never inside one. Each forward carries the
`forward:<mode>` annotation (`engine.scheduler.step.run_batch`), so a trace shows steps by mode.
Traces are Chrome-trace JSON (loadable in Perfetto / chrome://tracing / `json.load`), one file per
profile: `<output_dir>/<prefix>-<unix time>.trace.json`.

With `num_steps`, the profile stops by itself after that many forwards (the scheduler calls
`note_forward` after each; with overlap on, one more forward may already be queued and is
recorded too); `stop()` also stops it early. One profile at a time: starting a second, or
stopping none, is an InvalidRequestError.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.device import DeviceHandle, DeviceStream
from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

PROFILE_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"  # SGLang's variable for the default directory
ACTIVITIES = ("CPU", "GPU")


def default_profile_dir() -> str:
    return os.environ.get(PROFILE_DIR_ENV) or os.path.join(os.environ.get("TMPDIR", "/tmp"), "asyncllm-profiles")


class EngineProfiler:
    """One engine's profiler. `forward_count` reads how many forwards have completed so far (the
    scheduler's counter), for `num_steps`."""

    def __init__(self, stream: DeviceStream, forward_count: Callable[[], int], default_dir: str | None = None) -> None:
        self.stream = stream
        self.forward_count = forward_count
        self.default_dir = default_dir or default_profile_dir()
        self._prof: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._target: int | None = None  # stop once this many forwards have completed
        self._writing: asyncio.Future[Path] | None = None
        self._last: Path | None = None

    async def start(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        prefix: str = "asyncllm",
    ) -> Path:
        """Start profiling; returns the path the trace will be written to."""
        if self._prof is not None:
            raise InvalidRequestError("a profile is already running; stop it first", "profile")
        if num_steps is not None and (not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1):
            raise InvalidRequestError(f"num_steps must be an integer >= 1, got {num_steps!r}", "num_steps")
        chosen = list(activities) if activities else ["CPU", "GPU"]
        unknown = [a for a in chosen if a not in ACTIVITIES]
        if unknown:
            raise InvalidRequestError(f"unknown activities {unknown}; use {list(ACTIVITIES)}", "activities")
        kinds = [torch.profiler.ProfilerActivity.CPU] if "CPU" in chosen else []
        if "GPU" in chosen and torch.cuda.is_available():
            kinds.append(torch.profiler.ProfilerActivity.CUDA)
        if not kinds:
            raise InvalidRequestError("no activity to record on this machine (GPU only, and no GPU)", "activities")
        folder = Path(output_dir or self.default_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidRequestError(f"cannot create the profile directory {folder}: {e}", "output_dir") from None
        prof = torch.profiler.profile(activities=kinds)
        self._prof, self._path = prof, folder / f"{prefix}-{time.time_ns()}.trace.json"
        await self.stream.launch(prof.start)
        if num_steps is not None:
            self._target = self.forward_count() + num_steps
        log.info("profiling to %s (%s)", self._path, f"{num_steps} forwards" if num_steps else "until stopped")
        return self._path

    async def stop(self) -> Path:
        """Stop the running profile and write its trace; returns the trace's path."""
        return await self._write(*self._stop_now())

    def _stop_now(self) -> tuple[DeviceHandle[None], torch.profiler.profile, Path]:
        """Queue the profiler's stop on the stream at once (before any forward launched after this
        call) and forget the profile; `_write` exports it."""
        prof, path = self._prof, self._path
        if prof is None or path is None:
            raise InvalidRequestError("no profile is running", "profile")
        self._prof = self._path = self._target = None
        return self.stream.launch(prof.stop), prof, path

    async def _write(self, stopped: DeviceHandle[None], prof: torch.profiler.profile, path: Path) -> Path:
        await stopped
        await asyncio.to_thread(prof.export_chrome_trace, str(path))  # seconds for a long profile
        self._last = path
        log.info("profile written to %s", path)
        return path

    def note_forward(self, count: int) -> None:
        """The scheduler completed its `count`-th forward (called before it launches another, when
        it runs synchronously): a `num_steps` profile stops right here."""
        if self._target is not None and count >= self._target:
            self._writing = asyncio.ensure_future(self._write(*self._stop_now()))
            self._writing.add_done_callback(_log_failure)

    @property
    def last_trace(self) -> Path | None:
        """The latest trace written (by `stop` or after `num_steps`)."""
        return self._last

    async def close(self) -> None:
        """Stop (and write) a profile still running when the engine stops."""
        if self._writing is not None and not self._writing.done():
            await asyncio.wait([self._writing])
        if self._prof is not None:
            try:
                await self.stop()
            except Exception:  # never let a profile stop the engine's shutdown
                log.warning("could not write the running profile", exc_info=True)


def _log_failure(task: asyncio.Future[Path]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("could not write the profile", exc_info=task.exception())
