"""Where does the workspace backward's time go? Times each of its three launches (summed over all
vocabulary chunks) next to cuBLAS doing the same GEMMs, for several kernel configs.

    python benchmarks/probe_ws.py --configs '[{}, {"ws_block_do": 64}]' --out probe_ws.json

Inputs: random bf16 (every tile kept, the dense worst case), Gemma 2 2B shape by default.
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from probe import make_inputs, timeit  # noqa: E402

from cce_parallel import kernels  # noqa: E402
from cce_parallel.kernels import backward_ws as ws_mod  # noqa: E402
from cce_parallel.kernels.tiles import dot_precision  # noqa: E402


def launches(e, c, t, lse, a, b, scale, de, dc, ws, mask, cfg, which):
    n, d = e.shape
    v = c.shape[0]
    bn, bv, bd, bdo = cfg.bwd_block_n, cfg.bwd_block_v, cfg.bwd_block_d, cfg.ws_block_do
    vc = ws.shape[1]
    prec = dot_precision(e.dtype)
    common = dict(num_warps=cfg.bwd_num_warps, num_stages=cfg.bwd_num_stages)
    for lo in range(0, v, vc):
        hi = min(v, lo + vc)
        nv = triton.cdiv(hi - lo, bv)
        if "dlogits" in which:
            ws_mod._dlogits_kernel[(triton.cdiv(n, bn), nv)](
                e, c, lse, t, lse, a, b, lse, lse, t, scale, ws, mask, 1.0, n, v, d, lo, hi,
                e.stride(0), e.stride(1), c.stride(0), c.stride(1), ws.stride(0), mask.stride(0),
                HAS_BIAS=False, HAS_SOFTCAP=False, HAS_UNIFORM=False, SORTED=False, FILTER_E=False,
                FILTER_C=False, DOT_PRECISION=prec, BLOCK_N=bn, BLOCK_V=bv, BLOCK_D=bd, **common,
            )
        if "de" in which:
            ws_mod._ws_de_kernel[(triton.cdiv(n, bn), triton.cdiv(d, bdo))](
                ws, mask, c, t, lse, scale, de, n, d, lo, hi, ws.stride(0), mask.stride(0),
                c.stride(0), c.stride(1), de.stride(0), SORTED=False, CENTER_E=False, DOT_PRECISION=prec,
                BLOCK_N=bn, BLOCK_V=bv, BLOCK_DO=bdo, **common,
            )
        if "dc" in which:
            ws_mod._ws_dc_kernel[(nv, triton.cdiv(d, bdo))](
                ws, mask, e, t, scale, dc, lse, n, d, lo, hi, ws.stride(0), mask.stride(0), e.stride(0),
                e.stride(1), dc.stride(0), HAS_BIAS=False, SORTED=False, DOT_PRECISION=prec,
                BLOCK_N=bn, BLOCK_V=bv, BLOCK_DO=bdo, **common,
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=256000)
    ap.add_argument("--d", type=int, default=2304)
    ap.add_argument("--configs", default="[{}]")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, v, d = args.n, args.v, args.d
    e, c, t = make_inputs(n, v, d, "random", dev, torch.bfloat16)
    lse = torch.logsumexp((e @ c.T).float(), dim=1)
    a = torch.full((n,), 1.0 / n, device=dev)
    b = a.clone()
    scale = kernels.ws_scale(a, b)
    gflop = 2 * n * v * d / 1e9
    rows = []
    # cuBLAS doing the same three products, one chunk at a time (the floor for this structure).
    base = kernels.default_config(dev, torch.bfloat16)
    vc0 = base.bwd_workspace_bytes // (n * 2)
    wsb = torch.randn(n, vc0, device=dev, dtype=torch.bfloat16)
    cub = {
        "logits": timeit(lambda: [e @ c[lo:lo + vc0].T for lo in range(0, v, vc0)]),
        "de": timeit(lambda: [wsb[:, : min(vc0, v - lo)] @ c[lo:lo + vc0] for lo in range(0, v, vc0)]),
        "dc": timeit(lambda: [wsb[:, : min(vc0, v - lo)].T @ e for lo in range(0, v, vc0)]),
    }
    print("cuBLAS per-chunk:", {k: f"{ms:.1f} ms ({gflop / ms:.0f} TFLOP/s)" for k, ms in cub.items()}, flush=True)
    rows.append({"config": "cublas", **cub})
    fwd = timeit(lambda: kernels.lse_forward(e, c, None, t, None, need_zsum=False, need_colsum=False, config=base))
    print(f"forward: {fwd:.1f} ms ({gflop / fwd:.0f} TFLOP/s)", flush=True)
    rows.append({"config": "forward", "ms": fwd})
    for override in json.loads(args.configs):
        try:
            cfg = dataclasses.replace(base, **override)
            vc = max(cfg.bwd_block_v, cfg.bwd_workspace_bytes // (n * 2) // cfg.bwd_block_v * cfg.bwd_block_v)
            ws = torch.empty(n, vc, device=dev, dtype=torch.bfloat16)
            mask = torch.empty(triton.cdiv(n, cfg.bwd_block_n), vc // cfg.bwd_block_v, device=dev, dtype=torch.int8)
            de = torch.zeros(n, d, device=dev, dtype=torch.float32)
            dc = torch.empty_like(c)
            res = {}
            for which in (("dlogits",), ("de",), ("dc",), ("dlogits", "de", "dc")):
                res["+".join(which)] = timeit(
                    lambda which=which: launches(e, c, t, lse, a, b, scale, de, dc, ws, mask, cfg, which)
                )
            print(override, {k: f"{ms:.1f} ms ({gflop / ms:.0f} TF/s)" for k, ms in res.items()}, flush=True)
            rows.append({"config": override, **res})
        except Exception as err:  # noqa: BLE001 (a config that does not compile is reported)
            print(override, "failed:", repr(err)[:300], flush=True)
            rows.append({"config": override, "error": repr(err)[:300]})
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "n": n, "v": v, "d": d,
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
