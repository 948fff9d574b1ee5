"""A tiny, offline example of the loss layer: a byte-level language model trained with CCE.

    TRITON_INTERPRET=1 python -m cce_parallel.train.demo      # CPU, Triton kernels interpreted
    python -m cce_parallel.train.demo --device cuda            # GPU

The text is the docstrings of the installed Python standard library, so nothing is downloaded.
The model is an embedding, a causal 1-D convolution and an MLP; its output layer is the
classifier `c` that `cce_parallel.linear_cross_entropy` consumes without building logits.
"""

import argparse
import inspect
import math
import time

import torch

import cce_parallel


def stdlib_text(min_bytes: int) -> bytes:
    import collections
    import functools
    import json
    import os
    import pathlib
    import re
    import string

    chunks, size = [], 0
    for mod in (os, re, json, string, pathlib, collections, functools, inspect, math, argparse):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc:
                chunks.append(doc.encode("utf-8", "ignore"))
                size += len(chunks[-1])
        if size >= min_bytes:
            break
    return b"\n\n".join(chunks)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=256, dim=64, context=8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.conv = torch.nn.Conv1d(dim, dim, context, padding=context - 1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        self.norm = torch.nn.LayerNorm(dim)
        self.classifier = torch.nn.Parameter(torch.randn(vocab, dim) * dim**-0.5)

    def hidden(self, tokens):  # [b, s] -> [b, s, dim]
        x = self.embed(tokens)
        x = self.conv(x.transpose(1, 2))[..., : tokens.shape[1]].transpose(1, 2)
        return self.norm(x + self.mlp(x))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--impl", default="cce_kahan_full_c", choices=cce_parallel.IMPLS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    data = torch.tensor(list(stdlib_text(200_000)), dtype=torch.long)
    model = TinyLM().to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"{len(data)} bytes of stdlib docstrings; impl={args.impl}; device={args.device}")
    first = last = None
    t0 = time.time()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,))
        window = torch.stack([data[s : s + args.seq + 1] for s in starts]).to(args.device)
        inputs, targets = window[:, :-1], window[:, 1:]
        loss = cce_parallel.linear_cross_entropy(model.hidden(inputs), model.classifier, targets, impl=args.impl)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
        if step == 1 or step % 10 == 0:
            print(f"step {step:4d}  loss {last:.3f}  ({time.time() - t0:.1f}s)")
    print(f"loss {first:.3f} -> {last:.3f} (uniform over bytes: {math.log(256):.3f})")
    return 0 if last < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
