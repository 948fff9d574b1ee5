#!/bin/bash
# apex on the path, on the fixed tree: every test of tests/ops/test_one_pass.py on CUDA, then the one-GPU GPU tests of
# training, recompute, the megatron layer and the export; each pytest on its own basetemp, removed after.
exec > >(tee $OUT/probe.log) 2>&1
df -h /tmp | tail -1; du -sh /tmp/pytest-of-* 2>/dev/null; rm -rf /tmp/pytest-of-* /tmp/cce_* 2>/dev/null; df -h /tmp | tail -1
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl
[ -d /tmp/apexb ] || tar -xzf .probe/apex.tgz -C /tmp
export PYTHONPATH=$PWD:/tmp/site:/tmp/apexb:/tmp/apexb/wg
python3 -c "import apex, amp_C, fused_weight_gradient_mlp_cuda; from cce_parallel.train.gpt import have_grad_accumulation_fusion; print('apex', apex.__file__, 'fusion seen:', have_grad_accumulation_fusion())"
export CCE_TEST_GPU=1
timeout 200 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/bt1 tests/ops/test_one_pass.py 2>&1 | grep -v Deprecat | tail -8
rm -rf /tmp/bt1
timeout 340 python3 -m pytest -v -p no:cacheprovider --basetemp=/tmp/bt2 -rs --durations=10 -m gpu tests/e2e/test_train_gpu.py tests/e2e/test_recompute.py tests/megatron/test_megatron_gpu.py tests/hf/test_gpu_export.py > /tmp/gpu.log 2>&1
grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|^[0-9.]+s |Error" /tmp/gpu.log | tail -40
df -h /tmp | tail -1; rm -rf /tmp/bt2
