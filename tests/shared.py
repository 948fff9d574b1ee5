"""Expensive session fixtures built once per test run, also when pytest-xdist runs the suite in
several worker processes (``make test``: ``-n 2``).

``build_once(tmp_path_factory, name, build)`` calls ``build(path)`` on a fresh directory the first
time any worker asks for ``name``; the others wait on a file lock and get the same directory. A
build that raised leaves no mark, so the next caller builds again (and fails with its own error).
Without xdist it is a plain directory under the session's base temp.

What a worker's tests write into must stay the worker's own: ``worker_copy`` gives each worker its
copy of a shared directory (a prepared dataset, whose runs write their sample-index cache into it:
two runs building the same cache file at once could read each other's half-written file).
"""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock  # a dependency of torch

_DONE = ".built"


def worker() -> str | None:
    """This process's xdist worker id (gw0, gw1, ...), or None outside xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def shared_root(tmp_path_factory) -> Path:
    """A directory every worker of this run sees: the parent of the workers' base temps under
    xdist (pytest-of-<user>/pytest-<n>/), else the session's base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if worker() else base


def build_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """shared_root/name, built by build(path) once per test run, whichever worker asks first."""
    root = shared_root(tmp_path_factory)
    path = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (path / _DONE).exists():
            shutil.rmtree(path, ignore_errors=True)  # a build that failed half-way
            path.mkdir(parents=True)
            build(path)
            (path / _DONE).touch()
    return path


def worker_copy(tmp_path_factory, source: Path, name: str, ignore=()) -> Path:
    """source itself outside xdist; under xdist this worker's copy of it (without the names in
    ignore), made once per worker."""
    if not worker():
        return source
    copy = tmp_path_factory.getbasetemp() / name
    if not copy.exists():
        tmp = copy.with_name(copy.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(_DONE, *ignore))
        tmp.rename(copy)
    return copy
