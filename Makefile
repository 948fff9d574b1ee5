# The two commands of the README. Both work on a fresh CPU-only machine.
#
# Everything goes into the active virtualenv (VIRTUAL_ENV set), or else into the project's own,
# .venv, created on first use: so `make setup` works on a Python whose system packages pip must
# not touch (PEP 668, "externally managed"). PYTHON is the interpreter that creates .venv.
PYTHON ?= python3
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
PY := $(VENV)/bin/python

.PHONY: setup demo test test-gpu

# torch is pinned to its CPU build: an unpinned torch pulls GBs of CUDA packages. The test extra
# is megatron-core (the newest of 0.16.1-0.19.x this Python supports), tokenizers, pyyaml, wandb
# and pytest.
setup: $(PY)
	$(PY) -m pip install -q torch==2.13.0 -e '.[test]'
	@echo "cce_parallel is installed in $(VENV). In a new shell, run its commands as $(VENV)/bin/cce-train and" \
	      "$(VENV)/bin/python -m cce_parallel.train, or activate it first: . $(VENV)/bin/activate"

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The main job: the tiny recipe (recipes/tiny.yaml), a megatron-core GPT trained with CCE at TP=2
# over gloo, offline, on CPU (the data is tokenized on first use).
demo: setup
	$(PY) -m cce_parallel.train --recipe recipes/tiny.yaml

# CPU tests: Triton kernels under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1),
# in TEST_WORKERS pytest-xdist processes, one test module at a time each, the longest first
# (tests/conftest.py). `.venv/bin/python -m pytest tests/...` runs any part in one process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# On a CUDA machine: compiled kernels, bf16/fp16 at real shapes.
test-gpu:
	CCE_TEST_GPU=1 $(PY) -m pytest -q -s -p no:cacheprovider tests
