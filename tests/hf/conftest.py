"""tests/hf needs transformers, safetensors and megatron-core (the 'hf' and 'megatron' extras)."""

import importlib.util

collect_ignore_glob = (
    []
    if all(importlib.util.find_spec(name) for name in ("transformers", "safetensors", "megatron"))
    else ["test_*.py"]
)
