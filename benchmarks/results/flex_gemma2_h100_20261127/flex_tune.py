import time, torch, functools
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
import torch.nn.functional as F
dev = "cuda"; torch.manual_seed(0)
b, h, g, s, d = 4, 8, 4, 2048, 256
mk = lambda hh: torch.randn(b, hh, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
q, k, v = mk(h), mk(g), mk(g)
go = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
cap = 50.0
def score_mod(score, b_, h_, qi, ki):
    return cap * torch.tanh(score / cap)
mask = create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device=dev)
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
def sdpa():
    F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True).backward(go)
print("sdpa", round(bench(sdpa), 2))
opts = [None,
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32}]
for o in opts:
    torch._dynamo.reset()
    fa = torch.compile(flex_attention, dynamic=False)
    def f():
        fa(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=True, kernel_options=o).backward(go)
    try:
        print(o, round(bench(f), 2), flush=True)
    except Exception as e:
        print(o, "failed", type(e).__name__, str(e)[:150], flush=True)
