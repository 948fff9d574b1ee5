"""Print `name==version` for each named distribution that is installed (a pip constraints file).

    python docker/pin_installed.py torch triton numpy > /tmp/pins.txt
    PIP_CONSTRAINT=/tmp/pins.txt pip install -e ".[megatron,wandb,hf]"

Pinning what the base image ships keeps pip from replacing it (e.g. NGC's CUDA build of torch
with a PyPI wheel); a requirement that needs another version then fails loudly instead.
"""

import importlib.metadata
import sys

for name in sys.argv[1:]:
    try:
        print(f"{name}=={importlib.metadata.version(name)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"# {name}: not installed", file=sys.stderr)
