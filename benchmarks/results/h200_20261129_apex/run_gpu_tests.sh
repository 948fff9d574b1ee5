#!/bin/bash
# apex importable and numerically sane, then the one-GPU GPU tests with apex on the path (device tool).
exec > >(tee $OUT/probe.log) 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl
tar -xzf .probe/apex.tgz -C /tmp
export PYTHONPATH=$PWD:/tmp/site:/tmp/apexb:/tmp/apexb/wg
python3 - <<'PY'
import torch, amp_C, fused_weight_gradient_mlp_cuda, importlib
from apex.optimizers import FusedAdam
import megatron.core.optimizer as mo
print("megatron Adam:", mo.Adam)
p = torch.nn.Parameter(torch.randn(1000, device="cuda")); p.grad = torch.randn_like(p)
q = torch.nn.Parameter(p.detach().clone()); q.grad = p.grad.clone()
FusedAdam([p], lr=1e-3, weight_decay=0.1, adam_w_mode=True).step(); torch.optim.AdamW([q], lr=1e-3, weight_decay=0.1).step()
print("FusedAdam vs AdamW max diff", (p - q).abs().max().item())
x = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16); g = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
acc = torch.zeros(48, 32, device="cuda"); fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, g, acc)
print("wgrad fusion max diff", (acc - g.float().t() @ x.float()).abs().max().item())
from cce_parallel.train.gpt import have_grad_accumulation_fusion; print("fusion seen:", have_grad_accumulation_fusion())
PY
export CCE_TEST_GPU=1
timeout 480 python3 -m pytest -q -p no:cacheprovider -m gpu -rs --durations=8 tests/e2e/test_train_gpu.py tests/e2e/test_recompute.py tests/megatron/test_megatron_gpu.py tests/hf/test_gpu_export.py tests/ops/test_one_pass.py 2>&1 | grep -v Deprecat | tail -30
