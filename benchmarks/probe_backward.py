"""Where does the backward kernel's time go? Times kernels.cce_backward alone, on one shape, with
every tile skipped (recompute only), with nothing skipped, sorted or not, for several configs.

    python benchmarks/probe_backward.py --configs '[{}, {"bwd_block_n": 128}]'
"""

import argparse
import dataclasses
import json

import torch

from cce_parallel import kernels
from probe import make_inputs, timeit


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=256000)
    ap.add_argument("--d", type=int, default=2304)
    ap.add_argument("--configs", default="[{}]")
    args = ap.parse_args()
    dev = torch.device("cuda")
    e, c, t = make_inputs(args.n, args.v, args.d, "random", dev, torch.bfloat16)
    n, v = args.n, args.v
    lse = torch.full((n,), 20.0, device=dev)
    a = torch.full((n,), 1.0 / n, device=dev)
    b = a.clone()
    no_target = torch.full((n,), -1, device=dev, dtype=torch.long)
    thr_all = torch.full((n,), float("inf"), device=dev)
    perm = torch.randperm(v, device=dev)
    flops = 2 * n * v * args.d
    base = kernels.default_config(dev)
    for override in json.loads(args.configs):
        cfg = dataclasses.replace(base, **override)
        de = torch.zeros(e.shape, device=dev, dtype=torch.float32)
        dc = torch.zeros_like(c)
        variants = {
            "skip all (recompute)": dict(targets=no_target, threshold=thr_all, perm=None, fe=True, fc=True),
            "skip all, sorted": dict(targets=no_target, threshold=thr_all, perm=perm, fe=True, fc=True),
            "dense": dict(targets=t, threshold=None, perm=None, fe=False, fc=False),
        }
        for name, k in variants.items():
            def call():
                kernels.cce_backward(
                    e, c, None, k["targets"], lse, a, b, None, k["threshold"], k["perm"], None, de, dc, None, None,
                    softcap=None, v_lo=0, v_hi=v, filter_e=k["fe"], filter_c=k["fc"], dc_by_position=False,
                    config=cfg,
                )
            ms = timeit(call, reps=3 if name == "dense" else 5)
            print(f"{json.dumps(override):45s} {name:22s} {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s (recompute count)", flush=True)


if __name__ == "__main__":
    main()
