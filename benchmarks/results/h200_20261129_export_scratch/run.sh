#!/bin/bash
# tests/hf/test_gpu_export.py alone on one H200, on its own basetemp: does each case leave its directory empty?
exec > >(tee $OUT/probe.log) 2>&1
df -h /tmp | tail -1; rm -rf /tmp/pytest-of-* /tmp/cce_* 2>/dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/megatron_core*.whl
export PYTHONPATH=$PWD:/tmp/site CCE_TEST_GPU=1
( while sleep 15; do echo "disk: $(df -h /tmp | tail -1 | awk '{print $3}') used; bt: $(du -sh /tmp/bt 2>/dev/null | cut -f1)"; done ) &
W=$!
timeout 450 python3 -m pytest -v -s -p no:cacheprovider --basetemp=/tmp/bt -rs --durations=5 tests/hf/test_gpu_export.py 2>&1 | grep -v Deprecat | tail -40
kill $W
echo "after: $(du -sh /tmp/bt 2>/dev/null)"; find /tmp/bt -type f | head; df -h /tmp | tail -1; rm -rf /tmp/bt
