"""Which fixed kernel configuration is fastest on this GPU? Times impl "cce" (forward, and
forward+backward) for a list of KernelConfig overrides on one shape, in one process.

    python benchmarks/sweep_configs.py --regime peaked --configs '[{}, {"fwd_block_v": 256}]'
"""

import argparse
import json
import os

import torch

import cce_parallel as cp
from probe import make_inputs, timeit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=256000)
    ap.add_argument("--d", type=int, default=2304)
    ap.add_argument("--regime", default="peaked")
    ap.add_argument("--impl", default="cce")
    ap.add_argument("--configs", required=True, help="JSON list of KernelConfig overrides")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    e, c, t = make_inputs(args.n, args.v, args.d, args.regime, torch.device("cuda"), torch.bfloat16)
    ei, ci = e.detach().requires_grad_(), c.detach().requires_grad_()
    rows = []
    for override in json.loads(args.configs):
        os.environ["CCE_PARALLEL_KERNEL_CONFIG"] = json.dumps(override)
        try:
            fwd = timeit(lambda: cp.linear_cross_entropy(e, c, t, impl=args.impl))

            def step():
                ei.grad = ci.grad = None
                cp.linear_cross_entropy(ei, ci, t, impl=args.impl).backward()

            both = None if args.fwd_only else timeit(step, reps=5)
            rows.append(dict(config=override, fwd_ms=fwd, fwdbwd_ms=both))
        except Exception as exc:
            rows.append(dict(config=override, error=f"{type(exc).__name__}: {exc}"[:300]))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
