"""The compiled-extension cache (engine/kernels/cached_build.py): key, atomic publish, build lock.

The mechanism is checked with a tiny extension (a few lines of the Python C API, compiled through
the same `cached_build` the CPU kernels use) so each build takes about a second; the real kernels
take minutes on 2 cores and are built by tests/test_cpu_attention_kernels.py. Every test uses its
own cache folder ($ASYNCLLM_KERNEL_CACHE). "Compiled or not" is read from the build's log line and
the .so's inode and mtime, never from timings.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.child_process import die_with_parent
from engine.kernels import cached_build as build

# torch's builder defines TORCH_EXTENSION_NAME (the cache folder's name); the module's init
# function must carry it, hence the token pasting.
TINY = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(a) #a
#define STR(a) STR2(a)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A tiny extension's sources (`answer()` returns 42) and a private cache root."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text('#include "answer.h"\n' + TINY)
    (src / "answer.h").write_text("#define ANSWER 42\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("ASYNCLLM_KERNEL_CACHE", str(cache))
    return src, cache


def _args(src: Path) -> dict:
    return {"sources": [src / "tiny.cpp"], "depends": [src / "answer.h"], "cflags": ["-O1"]}


def _folder(src: Path) -> Path:
    a = _args(src)
    return build.build_folder("tiny", a["sources"], a["depends"], a["cflags"])


# A fresh Python process that loads the tiny extension through cached_build, as an engine start does.
LOADER = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from engine.kernels import cached_build as build
src = Path(sys.argv[1])
what = "the tiny test extension"
m = build.cached_build("tiny", [src / "tiny.cpp"], depends=[src / "answer.h"], cflags=["-O1"], what=what)
print("answer", m.answer())
"""


def _start(src: Path, cache: Path, code: str = LOADER) -> subprocess.Popen:
    env = {**os.environ, "ASYNCLLM_KERNEL_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    parent = os.getpid()
    return subprocess.Popen(
        [sys.executable, "-c", code, str(src)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: die_with_parent(parent),
    )


def _run(src: Path, cache: Path, code: str = LOADER) -> subprocess.CompletedProcess:
    p = _start(src, cache, code)
    out, err = p.communicate(timeout=600)  # a hang guard only
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_key_is_stable_and_covers_every_input(tiny):
    src, _ = tiny
    a = _args(src)
    inputs = build.build_inputs(a["sources"], a["depends"], a["cflags"])
    assert build.build_inputs(a["sources"], a["depends"], a["cflags"]) == inputs
    key = build.build_key(inputs)
    assert build.build_key(dict(reversed(list(inputs.items())))) == key  # order of the fields is irrelevant
    # The inputs name this interpreter's torch installation, Python and compiler.
    assert inputs["torch_dir"] == str(Path(torch.__file__).resolve().parent)
    assert torch.__version__ in inputs["torch_version"]
    assert sys.version in inputs["python"]
    assert os.path.realpath(build.shutil.which("c++")) in inputs["compiler"]

    # Another venv (torch path), another torch, Python, compiler, CPU or flags: another build.
    for field, other in [
        ("torch_dir", "/other/checkout/.venv/lib/python3.11/site-packages/torch"),
        ("torch_version", "2.99.0+cpu"),
        ("python", "3.12.1"),
        ("compiler", "/usr/bin/clang++ clang version 18"),
        ("cpu", "x86_64 sse2"),
        ("cflags", '["-O2"]'),
    ]:
        assert build.build_key({**inputs, field: other}) != key, field
    assert build.build_key(build.build_inputs(a["sources"], a["depends"], ["-O1", "-g"])) != key
    assert build.build_key(build.build_inputs(a["sources"], a["depends"], a["cflags"], ["-lm"])) != key

    # The sources' and headers' contents, not their timestamps.
    (src / "answer.h").write_text("#define ANSWER 43\n")
    assert build.build_key(build.build_inputs(a["sources"], a["depends"], a["cflags"])) != key
    (src / "answer.h").write_text("#define ANSWER 42\n")
    os.utime(src / "tiny.cpp", (0, 0))
    assert build.build_key(build.build_inputs(a["sources"], a["depends"], a["cflags"])) == key
    (src / "tiny.cpp").write_text((src / "tiny.cpp").read_text() + "\n// edited\n")
    assert build.build_key(build.build_inputs(a["sources"], a["depends"], a["cflags"])) != key


def test_second_process_loads_the_cached_build_without_compiling(tiny):
    src, cache = tiny
    first = _run(src, cache)
    assert first.returncode == 0, first.stderr
    assert "answer 42" in first.stdout
    assert first.stderr.count("building the tiny test extension") == 1
    assert first.stderr.count("built the tiny test extension in") == 1
    folder = _folder(src)
    so = folder / f"{folder.name}.so"
    before = so.stat()

    second = _run(src, cache)
    assert second.returncode == 0, second.stderr
    assert "answer 42" in second.stdout
    assert "building" not in second.stderr and "built" not in second.stderr
    after = so.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    # One complete folder, its unheld lock file, and no temp folder.
    assert sorted(p.name for p in cache.iterdir()) == [folder.name, f"{folder.name}.lock"]
    assert (cache / f"{folder.name}.lock").read_text() == ""


def test_stale_lock_of_a_dead_process_is_cleared_and_the_build_proceeds(tiny, caplog):
    src, cache = tiny
    folder = _folder(src)
    cache.mkdir()
    dead = _dead_pid()
    (cache / f"{folder.name}.lock").write_text(f"{dead}\n")
    # What that process left mid-build: a temp folder with torch's lock and half the outputs.
    leftover = cache / f".{folder.name}.building-{dead}-x1y2"
    leftover.mkdir()
    (leftover / "lock").touch()
    (leftover / "tiny.o").write_bytes(b"\0" * 100)
    (leftover / f"{folder.name}.so").write_bytes(b"not an elf")

    with caplog.at_level(logging.INFO, logger="engine.kernels.cached_build"):
        module = build.cached_build("tiny", what="the tiny test extension", **_args(src))
    assert module.answer() == 42
    assert caplog.text.count(f"cleared a stale build lock left by pid {dead}") == 1
    assert caplog.text.count(f"removing an interrupted build (pid {dead})") == 1
    assert caplog.text.count("building the tiny test extension") == 1
    assert not leftover.exists()
    assert (folder / f"{folder.name}.so").is_file()
    assert (cache / f"{folder.name}.lock").read_text() == ""  # released: no pid left behind


# A start killed in the middle of the build (as by OOM or a test timeout): the compiler has
# written some outputs into the build folder when SIGKILL arrives.
KILLED_MID_BUILD = """
import os, signal, sys
from pathlib import Path
from torch.utils import cpp_extension
def half_build(name, sources, build_directory, **kwargs):
    d = Path(build_directory)
    (d / "lock").touch()
    (d / "tiny.o").write_bytes(b"half")
    (d / (name + ".so")).write_bytes(b"truncated")
    os.kill(os.getpid(), signal.SIGKILL)
cpp_extension.load = half_build
from engine.kernels import cached_build as build
src = Path(sys.argv[1])
build.cached_build("tiny", [src / "tiny.cpp"], depends=[src / "answer.h"], cflags=["-O1"])
"""


def test_interrupted_build_leaves_nothing_trusted(tiny):
    src, cache = tiny
    folder = _folder(src)
    killed = _run(src, cache, KILLED_MID_BUILD)
    assert killed.returncode == -signal.SIGKILL
    assert not folder.exists()  # nothing at the path a start loads from
    (leftover,) = cache.glob(f".{folder.name}.building-*")
    assert (leftover / f"{folder.name}.so").read_bytes() == b"truncated"
    pid = int((cache / f"{folder.name}.lock").read_text())

    after = _run(src, cache)
    assert after.returncode == 0, after.stderr
    assert "answer 42" in after.stdout
    assert f"cleared a stale build lock left by pid {pid}" in after.stderr
    assert f"removing an interrupted build (pid {pid})" in after.stderr
    assert after.stderr.count("building the tiny test extension") == 1
    assert sorted(p.name for p in cache.iterdir()) == [folder.name, f"{folder.name}.lock"]


def test_live_lock_is_waited_on_and_named(tiny):
    src, cache = tiny
    folder = _folder(src)
    cache.mkdir()
    lock = cache / f"{folder.name}.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        waiter = _start(src, cache)
        for line in waiter.stderr:  # ends (EOF) if the waiter exits instead of waiting
            if "waiting for" in line:
                break
        assert f"waiting for pid {os.getpid()}, which is building the tiny test extension" in line
        assert waiter.poll() is None and not folder.exists()
        held.truncate(0)  # a clean release, as build.py's own does
    out, err = waiter.communicate(timeout=600)  # a hang guard only
    assert waiter.returncode == 0, err
    assert "answer 42" in out
    assert "stale" not in err
    assert err.count("building the tiny test extension") == 1


def test_failed_build_leaves_no_folder_and_no_lock_holder(tiny):
    src, cache = tiny
    (src / "tiny.cpp").write_text("this is not C++\n")
    folder = _folder(src)
    with pytest.raises(Exception, match="Error building extension"):
        build.cached_build("tiny", **_args(src))
    assert sorted(p.name for p in cache.iterdir()) == [f"{folder.name}.lock"]
    assert (cache / f"{folder.name}.lock").read_text() == ""


def test_cached_build_that_does_not_load_is_rebuilt(tiny):
    """A complete folder whose .so no longer imports (a disk that filled up, a hand edit) is
    reported and rebuilt rather than failing every start."""
    src, cache = tiny
    assert _run(src, cache).returncode == 0
    folder = _folder(src)
    so = folder / f"{folder.name}.so"
    broken = so.with_suffix(".tmp")
    broken.write_bytes(b"not an elf")
    broken.replace(so)

    again = _run(src, cache)
    assert again.returncode == 0, again.stderr
    assert "answer 42" in again.stdout
    assert f"the cached build {so} does not load" in again.stderr
    assert again.stderr.count("building the tiny test extension") == 1
    assert so.read_bytes()[:4] == b"\x7fELF"
