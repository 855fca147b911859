"""Give freed host memory back to the operating system when the engine goes idle.

glibc keeps the memory a burst of large batches freed (logits, activations, host copies) in its
heap: the process's RSS then stays at the burst's high-water mark, which looks like a leak to
an operator and to any RSS-based check (bench.soak saw +30 to +78 MB after warm-up that
`malloc_trim(0)` returned at once). Trimming on the engine's busy -> idle edge returns it at a
moment when nothing waits for the scheduler; at most once per `MIN_INTERVAL_S`, so a server that
goes idle between every request does not pay for it each time. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 30.0


def _load_malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()
_last_trim = float("-inf")


def trim_host_memory(force: bool = False) -> bool:
    """Return freed heap memory to the OS (rate-limited unless `force`); True if it ran."""
    global _last_trim
    now = time.monotonic()
    if _malloc_trim is None or (not force and now - _last_trim < MIN_INTERVAL_S):
        return False
    _last_trim = now
    _malloc_trim(0)
    log.debug("malloc_trim took %.1f ms", (time.monotonic() - now) * 1e3)
    return True
