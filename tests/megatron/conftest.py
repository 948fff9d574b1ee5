"""tests/megatron needs megatron-core (the 'megatron' extra); without it these modules are not collected."""

import importlib.util

collect_ignore_glob = (
    []
    if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core")
    else ["test_*.py"]
)
