"""The compiled-extension cache, and `python -m engine.kernels.build` (run by `make setup`).

`cached_build(name, sources, ...)` compiles a torch C++ extension once per machine and build
environment, and every later start loads the cached .so without compiling. The CPU kernels
(cpu_extension.py) use it; so do the tests, with a tiny source, to check the mechanism in seconds.

Layout under the cache root ($ASYNCLLM_KERNEL_CACHE, else $XDG_CACHE_HOME/asyncllm/kernels, else
~/.cache/asyncllm/kernels):

    <name>_<key>/<name>_<key>.so            a complete build; only a rename ever creates the folder
    <name>_<key>.lock                       flock'd by the one process building <key>; holds its pid
    .<name>_<key>.building-<pid>-<random>/  a build in progress, or one left by a killed process

Why this shape:
- The key hashes everything the .so depends on (`build_inputs`): torch's install path and version,
  Python's version and ABI, the compiler (path and version), the flags, the sources' contents and the
  CPU features `-march=native` targets. Two checkouts with two venvs therefore get two folders: torch's
  generated build.ninja names its venv's include dirs, so a shared folder was rebuilt (minutes) each
  time the other checkout started.
- A build runs in a fresh temp folder renamed into place when complete (atomic within one
  filesystem): a build killed mid-way (^C, a test timeout, OOM) leaves only a temp folder, which no
  start trusts and the next builder of that key deletes. torch's own `lock` file, which its builder
  waits on forever, is only ever created inside such a temp folder, so no later start meets it.
- Builders of one key serialise on our own lock file with flock: the kernel releases it when its
  holder dies, so a dead holder can never block a start; the pid written in it names who is building
  (for the "waiting" line) or, when it is found unheld, which killed build it was left by.

`python -m engine.kernels.build` never fails: a machine that cannot build the kernels still serves,
on the torch paths.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

# Bumped when the key's inputs change meaning, so an old cache entry is never mistaken for a new one.
KEY_FORMAT = 2
LIB_EXT = ".pyd" if os.name == "nt" else ".so"
_BUILDING = ".building-"


def user_cache_home() -> Path:
    """The project's per-user cache folder: $XDG_CACHE_HOME/asyncllm, else ~/.cache/asyncllm (a
    relative $XDG_CACHE_HOME is invalid by the XDG spec and ignored)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "asyncllm"


def cache_root() -> Path:
    return Path(os.environ.get("ASYNCLLM_KERNEL_CACHE", user_cache_home() / "kernels"))


@functools.cache
def _compiler() -> str:
    """The compiler torch's builder will run ($CXX, else `c++`), resolved through symlinks
    (Debian's alternatives), with its version line: a compiler upgrade changes the key."""
    cxx = os.environ.get("CXX", "c++")
    path = os.path.realpath(shutil.which(cxx) or cxx)
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
        version = out.splitlines()[0] if out.strip() else "no version"
    except (OSError, subprocess.SubprocessError) as e:
        version = f"not runnable ({type(e).__name__})"
    return f"{path} {version}"


@functools.cache
def _cpu_features() -> str:
    """What `-march=native` compiles for: the machine and this CPU's feature flags."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, arm64
                flags = line.split(":", 1)[-1].strip()
                break
    return f"{platform.machine()} {flags}"


def build_inputs(
    sources: Sequence[str | Path],
    depends: Sequence[str | Path] = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
) -> dict[str, str]:
    """Everything a build's output depends on, by name; `build_key` hashes it. `depends` are files
    that are not compiled themselves (headers) but change the output."""
    digest = hashlib.sha256()
    for path in sorted({Path(p).resolve() for p in (*sources, *depends)}):
        # The name, not the absolute path: two checkouts of the same sources may share a build.
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return {
        "format": str(KEY_FORMAT),
        "torch_dir": str(Path(torch.__file__).resolve().parent),
        "torch_version": f"{torch.__version__} {torch.version.git_version} cxx11abi={torch.compiled_with_cxx11_abi()}",
        "python": f"{sys.version} {sysconfig.get_config_var('SOABI')} {sys.abiflags}",
        "compiler": _compiler(),
        "cflags": json.dumps(list(cflags)),
        "ldflags": json.dumps(list(ldflags)),
        "sources": digest.hexdigest(),
        "cpu": _cpu_features(),
    }


def build_key(inputs: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(inputs), sort_keys=True).encode()).hexdigest()[:16]


def build_folder(
    name: str,
    sources: Sequence[str | Path],
    depends: Sequence[str | Path] = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
) -> Path:
    """Where `cached_build` keeps (or will keep) this build."""
    return cache_root() / f"{name}_{build_key(build_inputs(sources, depends, cflags, ldflags))}"


def _put_venv_bin_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the pip-installed one sits next to this Python,
    which is not on PATH when the venv is used without being activated (`.venv/bin/python ...`)."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bin_dir not in path.split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + path if path else bin_dir


def _import(module_name: str, so: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_complete(folder: Path) -> ModuleType | None:
    """The module of a complete build in `folder`, or None. A folder exists only once its build
    finished (see the module docstring), so its .so is trusted; one that still fails to import (a
    disk that filled up, a hand edit) is reported and treated as missing, to be rebuilt."""
    so = folder / f"{folder.name}{LIB_EXT}"
    if not so.is_file():
        return None
    try:
        return _import(folder.name, so)
    except (ImportError, OSError) as e:
        log.warning("the cached build %s does not load (%s); rebuilding it", so, e)
        return None


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or "x")
    return None


@contextlib.contextmanager
def _build_lock(path: Path, what: str) -> Iterator[None]:
    """Hold the build lock for one key: waits (saying for whom) while a live process builds it;
    a lock whose holder died is free by construction (flock), and its pid is cleared with a line."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                who = f"pid {holder}" if holder else "another process"
                log.warning("waiting for %s, which is building %s (lock %s)", who, what, path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # A filesystem without flock (some NFS): build unlocked; the temp folder and the
            # rename still keep any half-made build out of use.
            log.warning("cannot lock %s (%s); building without a lock", path, e)
        if held:
            stale = _read_pid(fd)
            if stale is not None:  # a holder always clears its pid on the way out, unless killed
                log.warning("cleared a stale build lock left by pid %d (no longer running): %s", stale, path)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        if held:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        os.close(fd)  # releases the flock


def _remove_interrupted(root: Path, full: str) -> None:
    """Delete this key's temp folders. Called with the key's lock held, so no live process is
    building into any of them: each was left by a killed build (pid in its name)."""
    for tmp in root.glob(f".{full}{_BUILDING}*"):
        pid = tmp.name[len(f".{full}{_BUILDING}") :].split("-", 1)[0]
        log.warning("removing an interrupted build (pid %s): %s", pid, tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _compile(full: str, folder: Path, sources: Sequence[str | Path], cflags, ldflags, what: str) -> ModuleType:
    from torch.utils import cpp_extension

    tmp = Path(tempfile.mkdtemp(prefix=f".{full}{_BUILDING}{os.getpid()}-", dir=folder.parent))
    log.warning("building %s (first start on this machine/torch; takes a few minutes): %s", what, folder)
    started = time.monotonic()
    try:
        _put_venv_bin_on_path()
        # torch renames a module it has already built in this process (with other inputs) to
        # `<name>_v1`, whose .so would never be found under `<name>`: a retry must reuse the name.
        with contextlib.suppress(AttributeError):
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(full, None)
        module = cpp_extension.load(
            name=full,
            sources=[str(s) for s in sources],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(tmp),
            verbose=False,
        )
        tmp.chmod(0o755)  # mkdtemp makes it private; a shared $ASYNCLLM_KERNEL_CACHE must stay readable
        os.rename(tmp, folder)  # the build is complete: publish it in one step
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("built %s in %.1f s: %s", what, time.monotonic() - started, folder)
    return module


def cached_build(
    name: str,
    sources: Sequence[str | Path],
    *,
    depends: Sequence[str | Path] = (),
    cflags: Sequence[str] = (),
    ldflags: Sequence[str] = (),
    what: str | None = None,
) -> ModuleType:
    """The extension `name` built from `sources`: the cached build for these inputs, else compiled
    now (once per key across processes). Raises whatever the compiler raised."""
    what = what or name
    folder = build_folder(name, sources, depends, cflags, ldflags)
    module = _load_complete(folder)
    if module is not None:
        return module
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder.parent / f"{folder.name}.lock", what):
        module = _load_complete(folder)  # built by the process we waited for
        if module is not None:
            return module
        _remove_interrupted(folder.parent, folder.name)
        if folder.exists():  # complete but not loadable (see _load_complete)
            shutil.rmtree(folder)
        return _compile(folder.name, folder, sources, cflags, ldflags, what)
