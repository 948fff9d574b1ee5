#!/bin/bash
# Device: build apex's amp_C, apex_C, fused_layer_norm_cuda, fused_weight_gradient_mlp_cuda for sm_90;
# $OUT/apex.tgz holds apex/ + the extensions (fused_weight_gradient_mlp_cuda under wg/).
exec > >(tee $OUT/probe.log) 2>&1
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl .whl/ninja*.whl
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site
which ninja; ninja --version; nvcc --version | tail -2; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
t0=$(date +%s)
( cd .probe && timeout 420 python3 apex_setup.py build_ext --build-lib /tmp/apexb --build-temp /tmp/apext ) > $OUT/build.log 2>&1
echo "== build rc $? in $(( $(date +%s) - t0 )) s"; tail -5 $OUT/build.log
mkdir -p /tmp/apexb/wg && mv /tmp/apexb/fused_weight_gradient_mlp_cuda*.so /tmp/apexb/wg/ && cp -r .probe/apex_src/apex /tmp/apexb/
ls -la /tmp/apexb /tmp/apexb/wg
tar -czf $OUT/apex.tgz -C /tmp apexb; ls -la $OUT/apex.tgz
