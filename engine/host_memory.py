"""Host memory the OS manages for us: freed heap given back when idle, huge pages for the KV pool.

`trim_host_memory` — give freed host memory back to the operating system when the engine goes idle.

glibc keeps the memory a burst of large batches freed (logits, activations, host copies) in its
heap: the process's RSS then stays at the burst's high-water mark, which looks like a leak to
an operator and to any RSS-based check (bench.soak saw +30 to +78 MB after warm-up that
`malloc_trim(0)` returned at once). The scheduler trims on every busy -> idle edge, a moment when
nothing waits for it; with the default model loaded a trim takes 0.1-1.5 ms. (A time-based rate
limit made two idle readings disagree: one trimmed, the next not.) Elsewhere than glibc it is a
no-op.

`zeros_on_huge_pages` — the CPU KV pool's buffers. A decode reads each request's K/V rows at its
slots, and once requests have come and gone those slots are scattered over the pool: with 4 KiB
pages nearly every row is a TLB miss and a page walk. On 2 MiB pages (transparent huge pages,
`madvise(MADV_HUGEPAGE)`, which works where the system's THP mode is `always` or `madvise`) the
bf16 decode kernel read scattered slots 1.4-1.6x faster (30 layers, batch 64-128, 64-100 keys,
2 threads; docs/PERFORMANCE.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20  # x86-64 and arm64 transparent huge page size


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


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose memory is asked to be backed by transparent huge pages.

    The buffer is an anonymous mapping aligned to `HUGE_PAGE` and advised before any page is
    touched, then filled (so it is resident from the start, as `torch.zeros` was, and no page
    fault lands in a forward). The tensor keeps the mapping alive. Where the platform has no
    `MADV_HUGEPAGE`, or the buffer is smaller than one huge page, this is `torch.zeros`.
    """
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -base % HUGE_PAGE
    try:
        region.madvise(advice, offset, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # a kernel without THP: plain pages, still correct
        pass
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    tensor = flat.view(dtype).view(shape)
    tensor.zero_()
    return tensor
