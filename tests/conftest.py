"""Shared pytest setup: Triton interpreter switch, seeding, marks and device helpers.

On a CPU machine the Triton kernels run under the Triton interpreter, which reads
``TRITON_INTERPRET`` when ``triton`` is first imported, so this file sets it before
anything imports torch or triton. On the GPU machine run the suite with
``CCE_TEST_GPU=1`` so that the kernels are compiled for real.

Nothing here queries CUDA at import time, so collection works on a CPU-only machine.
"""

import os

if os.environ.get("CCE_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tests.helpers import gpu_run
from tests.interpreter import skip_nested_patching

skip_nested_patching()

_MARKS = {
    "gpu": "needs a CUDA GPU (skipped without one)",
    "distributed": "spawns several processes",
    "slow": "long-running",
    "interpreter": "runs the Triton kernels on CPU tensors (skipped without TRITON_INTERPRET=1, as with CCE_TEST_GPU=1)",
}


def pytest_configure(config):
    for name, doc in _MARKS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    # torch.cuda.is_available() does not create a CUDA context; it runs once, after collection.
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in gpu_items:
            item.add_marker(skip)
    if os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors would take impl="torch"'s path
        skip = pytest.mark.skip(reason="runs the Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")
        for item in items:
            if item.get_closest_marker("interpreter") is not None:
                item.add_marker(skip)
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        _longest_modules_first(items)


def _longest_modules_first(items):
    """For ``make test`` (``-n 2 --dist loadfile --no-loadscope-reorder``): each test module is one
    unit of work, so that what its tests share (module fixtures, the process groups that
    tests/parallel and tests/megatron cache per module) is built once, and the units go out in
    collection order, which this makes: modules with a ``slow`` test (end-to-end runs, tens of
    seconds each) first, then those with a ``distributed`` one (process groups), then the rest, so
    that the short ones fill the end. Every worker collects alike, so all agree on the order."""
    cost = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        rank = 0 if item.get_closest_marker("slow") else 1 if item.get_closest_marker("distributed") else 2
        cost[module] = min(cost.get(module, 2), rank)
    items.sort(key=lambda item: cost[item.nodeid.split("::")[0]])  # stable: a module's tests stay together


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def device() -> torch.device:
    """Device for the small fp32 kernel tests: the CPU (interpreter), or CUDA with CCE_TEST_GPU=1."""
    return torch.device("cuda") if gpu_run() else torch.device("cpu")


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device; skips the test where there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
