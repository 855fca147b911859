"""`FlightRecorder`: a bounded in-memory ring of msgpack-encoded events, dumped to a file on
demand (an actor crash, the watchdog, SIGUSR1, `POST /dump_flight_recorder`).

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
import time
from pathlib import Path

import msgspec

from engine.model_executor.model_runner import ModelRunner
from engine.recorder.events import (
    FORMAT_VERSION,
    BatchEvent,
    BudgetRec,
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
        self._put(RecvEvent(seq, t, actor, recorded_form(msg)))  # type: ignore[arg-type]

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
        self, step: int, token_ids: list[int], forward_s: float, out: OutRec, accepted: list[int] | None = None
    ) -> None:
        seq, t = self._stamp()
        self._put(ResultEvent(seq, t, step, token_ids, forward_s, out, accepted))

    def fail(self, step: int, error: str, out: OutRec) -> None:
        seq, t = self._stamp()
        self._put(FailEvent(seq, t, step, error, out))

    # ---- dumping ------------------------------------------------------------------------------

    def encode_dump(self, reason: str) -> bytes:
        """The dump file's bytes: the events are spliced in already encoded (no re-encoding)."""
        events = [msgspec.Raw(b) for b in self._ring]
        return _encoder.encode({"header": self.header, "reason": reason, "dropped": self.dropped, "events": events})

    def dump(self, reason: str, directory: str | os.PathLike[str] | None = None) -> Path:
        """Write the ring to `<dir>/flight-<time_ns>.msgpack` and return the path."""
        folder = Path(directory) if directory is not None else self.dump_dir
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"flight-{time.time_ns()}.msgpack"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(self.encode_dump(reason))
        tmp.replace(path)  # a reader never sees half a file
        self.last_dump = path
        log.warning("flight recorder: %d events dumped to %s (%s)", len(self._ring), path, reason)
        return path


def make_header(args: ServerArgs, runner: ModelRunner, enable_overlap: bool, threads: int | None) -> Header:
    """The recording's header: the options and memory shape replay rebuilds the scheduler from."""
    cfg = runner.model_config
    pool, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
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
        kv_pool_slots=alloc.num_pages * alloc.page_size,
        page_size=alloc.page_size,
        enable_overlap=enable_overlap,
        torch_threads=threads,
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
