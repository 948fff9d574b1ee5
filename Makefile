# The two commands of the README. Both work on a fresh CPU-only machine.
PY ?= python3

.PHONY: setup demo test test-gpu

setup:
	$(PY) -m pip install -q torch==2.13.0 triton numpy pytest pyyaml megatron-core==0.16.1 tokenizers
	$(PY) -m pip install -q --no-deps -e .

# The main job: the tiny recipe (recipes/tiny.yaml), a megatron-core GPT trained with CCE at TP=2
# over gloo, offline, on CPU (the data is tokenized on first use).
demo: setup
	$(PY) -m cce_parallel.train --recipe recipes/tiny.yaml

# CPU tests: Triton kernels under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

# On a CUDA machine: compiled kernels, bf16/fp16 at real shapes.
test-gpu:
	CCE_TEST_GPU=1 $(PY) -m pytest -q -s -p no:cacheprovider tests
