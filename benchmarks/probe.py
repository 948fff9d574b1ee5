"""Quick GPU probe for kernel development: does every impl compile and match, and how fast is it?

One question: for one shape, the bf16 error of each impl against an fp32 chunked reference, and the
forward and forward+backward time next to torch.compile, in one process. The full comparison with
every peer lives in bench_loss.py.

    python benchmarks/probe.py --n 8192 --v 256000 --d 2304 --regime peaked
"""

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import cce_parallel as cp


def make_inputs(n, v, d, regime, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    c = torch.randn(v, d, device=device, dtype=torch.float32, generator=g) / d**0.5
    if regime == "random":
        e = torch.randn(n, d, device=device, dtype=torch.float32, generator=g)
        t = torch.randint(0, v, (n,), device=device, generator=g)
    else:
        # A confident model whose logits carry the token's log-frequency (Zipf), as trained LMs' do:
        # z[n, v] ~ log f[v] + N(0, 1.5^2), plus ~10 on the target. The few entries above 2**-12
        # are then mostly frequent tokens, which vocabulary sorting groups into the same tiles.
        ranks = torch.arange(1, v + 1, device=device, dtype=torch.float32)
        log_f = torch.log(1.0 / ranks) - torch.log((1.0 / ranks).sum())
        t = torch.multinomial(log_f.exp(), n, replacement=True, generator=g)
        u = torch.randn(d, device=device, generator=g)
        u /= u.norm()
        c_rand = c
        c = c_rand + (log_f[:, None] / 4.0) * u[None, :]
        e = 10.0 * c_rand[t] + 1.5 * torch.randn(n, d, device=device, generator=g) + 4.0 * u[None, :]
    return e.to(dtype), c.to(dtype), t


def reference_grads(e, c, t, chunk=1024):
    """fp32 loss (mean) and grads from bf16 inputs upcast, chunked over tokens."""
    ef, cf = e.float(), c.float()
    n = e.shape[0]
    de = torch.empty_like(ef)
    dc = torch.zeros_like(cf)
    total = 0.0
    for lo in range(0, n, chunk):
        x = ef[lo : lo + chunk] @ cf.t()
        lse = torch.logsumexp(x, 1)
        total += (lse - x.gather(1, t[lo : lo + chunk, None])[:, 0]).sum().item()
        p = torch.softmax(x, 1)
        p[torch.arange(p.shape[0]), t[lo : lo + chunk]] -= 1
        p /= n
        de[lo : lo + chunk] = p @ cf
        dc += p.t() @ ef[lo : lo + chunk]
    return total / n, de, dc


def eager(e, c, t):
    return F.cross_entropy(F.linear(e, c).float(), t)


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def timeit(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        t.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(t))
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--v", type=int, default=256000)
    ap.add_argument("--d", type=int, default=2304)
    ap.add_argument("--regime", default="peaked", choices=["peaked", "random"])
    ap.add_argument("--impls", default=",".join(i for i in cp.IMPLS if i != "torch") + ",compile,eager")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    e, c, t = make_inputs(args.n, args.v, args.d, args.regime, dev, torch.bfloat16)
    ref_loss, ref_de, ref_dc = reference_grads(e, c, t)
    compiled = torch.compile(eager)
    rows = []
    print(f"{torch.cuda.get_device_name()} N={args.n} V={args.v} D={args.d} {args.regime}", flush=True)
    for name in args.impls.split(","):
        if name == "compile":
            fn = lambda e, c: compiled(e, c, t)  # noqa: E731
        elif name == "eager":
            fn = lambda e, c: eager(e, c, t)  # noqa: E731
        else:
            fn = lambda e, c, name=name: cp.linear_cross_entropy(e, c, t, impl=name)  # noqa: E731
        ei = e.detach().requires_grad_()
        ci = c.detach().requires_grad_()
        try:
            loss = fn(ei, ci)
            loss.backward()
            err = dict(loss=abs(loss.item() - ref_loss) / abs(ref_loss), de=rel(ei.grad, ref_de), dc=rel(ci.grad, ref_dc))
            fwd = timeit(lambda: fn(e, c))

            def step():
                ei.grad = ci.grad = None
                fn(ei, ci).backward()

            both = timeit(step)
            torch.cuda.synchronize()
            ei.grad = ci.grad = None
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            rows.append(dict(method=name, fwd_ms=fwd, fwdbwd_ms=both, peak_mb=peak, **err))
        except Exception as exc:  # keep going: this is a probe
            rows.append(dict(method=name, error=f"{type(exc).__name__}: {exc}"[:2000]))
        print(json.dumps(rows[-1]), flush=True)
        ei.grad = ci.grad = None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), args=vars(args), rows=rows), f, indent=1)
    print(f"{'method':18s} {'fwd ms':>8s} {'f+b ms':>8s} {'peak MB':>9s} {'loss err':>9s} {'dE err':>9s} {'dC err':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:18s} ERROR {r['error'][:200]}")
        else:
            print(
                f"{r['method']:18s} {r['fwd_ms']:8.2f} {r['fwdbwd_ms']:8.2f} {r['peak_mb']:9.1f} "
                f"{r['loss']:9.2e} {r['de']:9.2e} {r['dc']:9.2e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
