"""tests/hf needs transformers, safetensors and megatron-core (the 'hf' and 'megatron' extras)."""

import importlib.util

import pytest

collect_ignore_glob = (
    []
    if all(importlib.util.find_spec(name) for name in ("transformers", "safetensors", "megatron"))
    else ["test_*.py"]
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The stdlib text, 1,024-token BPE, first 2,000 documents: prepared once per test module."""
    from cce_parallel.config import Recipe
    from cce_parallel.train.data import prepare

    recipe = Recipe()
    recipe.data.dir = str(tmp_path_factory.mktemp("data") / "stdlib-bpe-1024")
    recipe.data.max_documents = 2000
    prepare(recipe.data)
    return recipe.data.dir
