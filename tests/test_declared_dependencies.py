"""Every module of the package imports with only what pyproject.toml declares (issue 32, item 7).

A fresh virtual environment per test run would download torch each time, so the same question is
asked faster and just as strictly: a site folder is assembled from symlinks to exactly the installed
distributions that `[project].dependencies` names, plus what they in turn require (their own
metadata, markers evaluated), and every module under engine/ and server/ is imported in an isolated
interpreter (`python -I -S`) that sees only that folder, the standard library and the repository.
A module that imports an undeclared package fails here with the package's name.

Modules whose import needs an optional extra are listed in OPTIONAL with the extra; each must fail
without it, so the list stays true.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL: dict[str, str] = {}  # module -> the extra it needs (none at present: extras import lazily)

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
failures = {}
for pkg in ("engine", "server"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        try:
            importlib.import_module(info.name)
        except Exception as e:  # the report names the module and what was missing
            failures[info.name] = f"{type(e).__name__}: {e}"
print(json.dumps(failures))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(requirements: list[str]) -> set[str]:
    """The distributions `requirements` need, transitively, as installed here."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in (md.distribution(req.name).requires or [])]
    return seen


def _site_of(dists: set[str], folder: Path) -> None:
    """Symlink each distribution's top-level files and folders (and its metadata) into `folder`."""
    for name in dists:
        dist = md.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if not Path(f).parts[0].startswith("..")}:
            target = folder / top
            if not target.exists() and (base / top).exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def declared_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    folder = tmp_path_factory.mktemp("declared-site")
    _site_of(_closure(project["dependencies"]), folder)
    return folder


def test_every_module_imports_with_declared_dependencies_only(declared_site: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _IMPORT_ALL, str(declared_site), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = json.loads(proc.stdout.strip().splitlines()[-1])
    unexpected = {m: why for m, why in failures.items() if m not in OPTIONAL}
    assert not unexpected, "modules that need an undeclared package:\n" + "\n".join(
        f"  {m}: {why}" for m, why in sorted(unexpected.items())
    )
    assert set(OPTIONAL) <= set(failures), f"listed as optional but imported without the extra: {OPTIONAL}"


def test_the_site_is_really_restricted(declared_site: Path) -> None:
    """The isolation holds: a test-only package installed here (pytest) is not importable there."""
    code = "import sys; sys.path[:0] = [sys.argv[1]]; import pytest"
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, str(declared_site)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "No module named 'pytest'" in proc.stderr
