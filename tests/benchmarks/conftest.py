"""The benchmark scripts (benchmarks/*.py, which import each other by their plain names) as modules."""

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def bench_loss():
    """benchmarks/bench_loss.py as a module."""
    return _script("bench_loss")


@pytest.fixture
def train():
    """benchmarks/train.py as a module."""
    return _script("train")
