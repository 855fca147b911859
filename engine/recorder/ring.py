"""`FlightRecorder`: a bounded in-memory ring of msgpack-encoded events, dumped to a file on
demand (an actor crash, the watchdog, SIGUSR1, `POST /dump_flight_recorder`).

What a dump holds: the header (server options, memory shape, `prompts_recorded`), then every
message the actors received and every scheduling decision: request ids, lengths, sampling
parameters, the sampled output token ids (replay's stand-in model) and timings, never output text
or logprobs. Prompts, stop strings and grammar specs only when `flight_recorder_record_prompts`
is on; by default a prompt is stand-in ids that keep only which prompts share which page-aligned
prefixes, and stop strings and grammar specs are their lengths (redact.py).

Dumps are private to the user the server runs as: the folder is made (or tightened to) mode 0700
and must belong to that user (one planted by another user, or a symlink of theirs, is refused:
they could read or swap what is written there), each file is 0600, and it is written to a temp
name and renamed, so a reader never sees half a dump.

Why encode at once: an event holds lists the scheduler goes on mutating (rids, token ids); bytes
are a snapshot, cost one `msgspec` call (~1-3 us), and weigh what the file will. The ring keeps
the newest `size` events; what it drops is counted, because replay needs a recording that starts
with the engine (`Dump.dropped == 0`).
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import logging
import os
import stat
import time
from pathlib import Path

import msgspec

from engine.cache.swa_pool import SWATokenToKVPoolAllocator
from engine.model_executor.model_runner import ModelRunner
from engine.recorder.events import (
    FORMAT_VERSION,
    BatchEvent,
    BudgetRec,
    ControlEvent,
    Dump,
    FailEvent,
    Header,
    OutRec,
    PlanEvent,
    PlanRec,
    RecvEvent,
    ResultEvent,
    RoundEvent,
    recorded_form,
)
from engine.recorder.redact import Redactor
from engine.server_args import ServerArgs

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()


class FlightRecorder:
    """Records events in one global order; `dump` writes header + events as one msgpack file."""

    def __init__(self, size: int, header: Header, dump_dir: str | os.PathLike[str]) -> None:
        if size < 1:
            raise ValueError(f"flight recorder size must be >= 1, got {size}")
        self.size = size
        self.header = header
        # Redacted at recording time, so users' prompts never sit in the ring's bytes either.
        self._redactor = None if header.prompts_recorded else Redactor(header.page_size)
        self.dump_dir = Path(dump_dir)
        self._ring: collections.deque[bytes] = collections.deque(maxlen=size)
        self._seq = 0
        self._t0 = time.perf_counter()
        self.last_dump: Path | None = None
        self.errors = 0  # events that could not be encoded (logged once)

    @property
    def recorded(self) -> int:
        """Events recorded since the start (kept or dropped)."""
        return self._seq

    @property
    def dropped(self) -> int:
        return self._seq - len(self._ring)

    def _stamp(self) -> tuple[int, float]:
        seq = self._seq
        self._seq += 1
        return seq, time.perf_counter() - self._t0

    def _put(self, event: msgspec.Struct) -> None:
        try:
            self._ring.append(_encoder.encode(event))
        except Exception:  # never let recording break the actor that records
            self.errors += 1
            if self.errors == 1:
                log.exception("flight recorder: cannot encode %s; it is skipped", type(event).__name__)

    # ---- what the actors call -----------------------------------------------------------------

    def recv(self, actor: str, msg: msgspec.Struct) -> None:
        """`actor` took `msg` out of its mailbox."""
        seq, t = self._stamp()
        form = recorded_form(msg)
        if self._redactor is not None:
            try:
                form = self._redactor.redact(form)
            except Exception:  # never record unredacted, never break the actor: count it as lost
                self.errors += 1
                log.exception("flight recorder: cannot redact %s; it is skipped", type(msg).__name__)
                return
        self._put(RecvEvent(seq, t, actor, form))  # type: ignore[arg-type]

    def round(self, budget: BudgetRec | None) -> None:
        seq, t = self._stamp()
        self._put(RoundEvent(seq, t, budget))

    def plan(self, reply_id: int, plan: PlanRec) -> None:
        seq, t = self._stamp()
        self._put(PlanEvent(seq, t, reply_id, plan))

    def batch(self, step: int, **decision: object) -> None:
        seq, t = self._stamp()
        self._put(BatchEvent(seq, t, step, **decision))  # type: ignore[arg-type]

    def result(
        self,
        step: int,
        token_ids: list[int],
        forward_s: float,
        out: OutRec,
        accepted: list[int] | None = None,
        stops: list[tuple[str, int]] | None = None,
    ) -> None:
        seq, t = self._stamp()
        self._put(ResultEvent(seq, t, step, token_ids, forward_s, out, accepted, stops))

    def fail(self, step: int, error: str, out: OutRec) -> None:
        seq, t = self._stamp()
        self._put(FailEvent(seq, t, step, error, out))

    def control(self, action: str, phase: str, error: str | None) -> None:
        seq, t = self._stamp()
        self._put(ControlEvent(seq, t, action, phase, error))

    # ---- dumping ------------------------------------------------------------------------------

    def encode_dump(self, reason: str) -> bytes:
        """The dump file's bytes: the events are spliced in already encoded (no re-encoding)."""
        events = [msgspec.Raw(b) for b in self._ring]
        return _encoder.encode({"header": self.header, "reason": reason, "dropped": self.dropped, "events": events})

    def dump(self, reason: str, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write the ring to `<dir>/flight-<time_ns>.msgpack` (mode 0600, in a 0700 folder of
        ours: see the module docstring) and return the path."""
        folder = Path(directory) if directory is not None else self.dump_dir
        name = f"flight-{time.time_ns()}.msgpack"
        write_private(folder, name, self.encode_dump(reason))
        path = folder / name
        self.last_dump = path
        log.warning("flight recorder: %d events dumped to %s (%s)", len(self._ring), path, reason)
        return path


def private_dir(folder: Path) -> int:
    """Open `folder` (made 0700 if missing) as a directory fd, after checking it is ours and
    tightening it to 0700; raise PermissionError for a folder or symlink of another user's."""
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    uid = os.geteuid()
    link = os.lstat(folder)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != uid:
        # Another user could point it anywhere, at any time: never write through it.
        raise PermissionError(f"{folder} is a symlink owned by uid {link.st_uid}, not us ({uid}): not writing there")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        st = os.fstat(fd)  # what was opened, not what the path names now
        if st.st_uid != uid:
            raise PermissionError(f"{folder} belongs to uid {st.st_uid}, not us ({uid}): not writing dumps there")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)  # ours, but others could list or read it
        return fd
    except BaseException:
        os.close(fd)
        raise


def write_private(folder: Path, name: str, data: bytes) -> None:
    """Write `folder/name` as a 0600 file, atomically (temp file + rename), in a private folder."""
    dir_fd = private_dir(folder)
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        # O_EXCL | O_NOFOLLOW: never reuse or follow something already at the temp name.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            os.fchmod(fd, 0o600)  # the mode above is before the umask; this is exact
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # a reader never sees half a file
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(dir_fd)


def make_header(args: ServerArgs, runner: ModelRunner, enable_overlap: bool, threads: int | None) -> Header:
    """The recording's header: the options and memory shape replay rebuilds the scheduler from."""
    cfg = runner.model_config
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    hybrid = alloc if isinstance(alloc, SWATokenToKVPoolAllocator) else None
    return Header(
        format_version=FORMAT_VERSION,
        build=_build(),
        created=time.time(),
        args=msgspec.to_builtins(dataclasses.asdict(args)),
        vocab_size=cfg.vocab_size,
        context_len=runner.context_len,
        eos_token_ids=sorted(cfg.eos_token_ids),
        req_pool_rows=pool.size,
        req_pool_width=pool.max_context_len,
        kv_pool_slots=(hybrid.full if hybrid is not None else alloc).num_pages * alloc.page_size,
        page_size=alloc.page_size,
        enable_overlap=enable_overlap,
        torch_threads=threads,
        prompts_recorded=args.flight_recorder_record_prompts,
        swa_pool_slots=hybrid.swa.num_pages * alloc.page_size if hybrid is not None else 0,
        swa_window=hybrid.window if hybrid is not None else 0,
    )


def _build() -> str:
    try:
        return f"asyncllm {importlib.metadata.version('asyncllm')}"
    except importlib.metadata.PackageNotFoundError:
        return "asyncllm (not installed)"


def load_dump(data: bytes | str | os.PathLike[str]) -> Dump:
    """Decode a dump (its bytes, or the path of its file)."""
    raw = data if isinstance(data, bytes) else Path(data).read_bytes()
    return msgspec.msgpack.decode(raw, type=Dump)
