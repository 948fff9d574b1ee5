#!/bin/bash
# The 21 tests of tests/ops/test_one_pass.py that run_gpu_tests.sh did not reach in its 200 s (ids from --collect-only).
exec > >(tee $OUT/probe.log) 2>&1
export PYTHONPATH=$PWD:/tmp/site:/tmp/apexb:/tmp/apexb/wg CCE_TEST_GPU=1
timeout 200 python3 -m pytest -q -p no:cacheprovider --basetemp=/tmp/bt3 $(cat benchmarks/results/h200_20261129_apex/one_pass_rest_ids.txt) 2>&1 | grep -v Deprecat | tail -8
