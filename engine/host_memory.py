"""Give freed host memory back to the operating system when the engine goes idle.

glibc keeps the memory a burst of large batches freed (logits, activations, host copies) in its
heap: the process's RSS then stays at the burst's high-water mark, which looks like a leak to
an operator and to any RSS-based check (bench.soak saw +30 to +78 MB after warm-up that
`malloc_trim(0)` returned at once). The scheduler trims on every busy -> idle edge, a moment when
nothing waits for it; with the default model loaded a trim takes 0.1-1.5 ms. (A time-based rate
limit made two idle readings disagree: one trimmed, the next not.) Elsewhere than glibc it is a
no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


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


def trim_host_memory() -> bool:
    """Return freed heap memory to the OS; False where there is no malloc_trim."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True
