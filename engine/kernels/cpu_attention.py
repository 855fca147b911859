"""The CPU paged attention kernels (csrc/cpu_attention.cpp): build once, call per layer.

The kernels are C++ compiled with torch's extension builder (`-O3 -march=native`, so they use
this machine's vector width; about 25 s), into a folder under ~/.cache/asyncllm/kernels named by a
hash of the source, the flags, this CPU's feature flags and the torch version. `make setup` builds
them (`python -m engine.kernels.build`), so servers and tests find them ready; otherwise
the first ModelRunner builds them. Anything that stops the build (no compiler, no ninja, an exotic
CPU) leaves the torch path in charge: `load()` returns None, logs why once, and the engine stays
correct, only slower. `ASYNCLLM_CPU_KERNELS=0` turns them off (A/B runs, bisecting).

torch's builder serialises concurrent builds with a lock file and waits for it forever; a build
killed mid-way (a test timeout, ^C) would leave it behind and hang every later start. A lock older
than STALE_LOCK_S, far longer than a build takes, is therefore removed before building.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
HEAD_DIMS = (64, 128)
STALE_LOCK_S = 600
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode()):
        digest.update(part)
    return f"asyncllm_cpu_attention_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    root = Path(os.environ.get("ASYNCLLM_KERNEL_CACHE", Path.home() / ".cache" / "asyncllm" / "kernels"))
    return root / _build_name()


def _clear_stale_lock(folder: Path) -> None:
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("removing a stale kernel build lock (%.0f s old): %s", age, lock)
        lock.unlink(missing_ok=True)


def _put_venv_bin_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits next to this Python,
    which is not on PATH when the venv is used without being activated (`.venv/bin/python ...`)."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path if path else bin_dir


def enabled() -> bool:
    return os.environ.get("ASYNCLLM_CPU_KERNELS", "1") not in ("0", "false", "no")


def load() -> ModuleType | None:
    """The compiled module, building it on the first call; None when it cannot be built."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                from torch.utils.cpp_extension import load as build

                _put_venv_bin_on_path()
                folder = build_directory()
                folder.mkdir(parents=True, exist_ok=True)
                _clear_stale_lock(folder)
                _module = build(name=folder.name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                                extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)  # fmt: skip
            except Exception as e:  # noqa: BLE001 - any build failure means "use the torch path"
                log.warning("CPU attention kernels unavailable, using the torch path: %s", e)
                _module = None
            _tried = True
    return _module


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernels handle attention on this device, dtype and head size."""
    return device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, D], lse [B, H] fp32) of one query per request over `slots[b, :lens[b]]`.

    q `[B, H, D]`; k_buf/v_buf `[S, KVH, D]` (one layer of the pool); slots int64 `[B, L]`;
    lens int64 `[B]` (each >= 1). Raises RuntimeError if the kernel is not built (check `load()`).
    """
    module = _module_or_raise()
    with torch.profiler.record_function("asyncllm::cpu_decode_attention"):  # named in profiles
        out, lse = module.decode_attention(q.contiguous(), k_buf, v_buf, slots, lens, scale)
    return out, lse


def extend_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
    prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each request's new tokens over its prefix and themselves: `[T, H, D]`.

    q `[T, H, D]` (requests' new tokens back to back); slots int64 `[R, L]`, row r holding
    request r's `prefix_lens[r] + extend_lens[r]` slots (the new tokens' K/V already written);
    prefix_lens/extend_lens int64 `[R]` (extend >= 1).
    """
    module = _module_or_raise()
    with torch.profiler.record_function("asyncllm::cpu_extend_attention"):
        return module.extend_attention(q.contiguous(), k_buf, v_buf, slots, prefix_lens, extend_lens, scale)


def _module_or_raise() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU attention kernels are not available")
    return module

