"""``python -m cce_parallel.export CHECKPOINT OUT_DIR``: see cce_parallel.hf.export."""

import sys

from cce_parallel.hf.export import main

if __name__ == "__main__":
    sys.exit(main())
