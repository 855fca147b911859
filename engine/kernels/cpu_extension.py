"""The CPU kernels' C++ extension (csrc/): build once per machine, load, or fall back to torch.

One extension holds every CPU kernel: paged attention (cpu_attention.py) and the fused
elementwise ops (cpu_elementwise.py). It is compiled with torch's extension builder (`-O3
-march=native`, so it uses this machine's vector width; about 30 s), into a folder under
~/.cache/asyncllm/kernels named by a hash of the sources, the flags, this CPU's feature flags and
the torch version. `make setup` builds it (`python -m engine.kernels.build`), so servers and tests
find it ready; otherwise the first ModelRunner builds it. Anything that stops the build (no
compiler, no ninja, an exotic CPU) leaves the torch paths in charge: `load()` returns None, logs
why once, and the engine stays correct, only slower. `ASYNCLLM_CPU_KERNELS=0` turns the kernels
off (A/B runs, bisecting).

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

CSRC = Path(__file__).parent / "csrc"
# Compiled units; the headers (*.h) only enter the build hash.
SOURCES = (
    "cpu_attention.cpp",
    "cpu_attention_bf16.cpp",
    "cpu_elementwise.cpp",
    "cpu_argmax.cpp",
    "cpu_quant_gemv.cpp",
    "cpu_decode_layers.cpp",
    "bindings.cpp",
)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
STALE_LOCK_S = 600

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
    for path in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    for part in (" ".join(CFLAGS).encode(), _cpu_flags().encode(), torch.__version__.encode()):
        digest.update(part)
    return f"asyncllm_cpu_kernels_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    root = Path(os.environ.get("ASYNCLLM_KERNEL_CACHE", Path.home() / ".cache" / "asyncllm" / "kernels"))
    return root / _build_name()


def clear_stale_lock(folder: Path) -> None:
    """Remove a build lock older than STALE_LOCK_S (torch's builder would wait on it forever)."""
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
                clear_stale_lock(folder)
                _module = build(
                    name=folder.name,
                    sources=[str(CSRC / s) for s in SOURCES],
                    extra_cflags=CFLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
            except Exception as e:  # any build failure means "use the torch path"
                log.warning("CPU kernels unavailable, using the torch paths: %s", e)
                _module = None
            _tried = True
    return _module


def module_or_raise() -> ModuleType:
    """The built module, for a kernel call. Once a build was tried this skips `load()`'s
    environment check: whether to use the kernels is decided when a layer or backend is built (a
    call costs ~0.5 µs, and a decode step makes ~150 of them)."""
    module = _module if _tried else load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available")
    return module
