#!/usr/bin/env bash
# One torchrun launch of bench_megatron_memory.py: peak memory per rank of one GPTModel step,
# Megatron's output path vs CCE, at V = 256,000 and TP = 2 by default.
#
#   benchmarks/run_bench_megatron_memory.sh OUT_DIR [bench_megatron_memory.py options...]
#   e.g. benchmarks/run_bench_megatron_memory.sh benchmarks/results --commit SHA --impls cce,cce_kahan_full_c
#
# Environment: NPROC (ranks, default 2 = TP 2), PYTHON (default python3), LAUNCH_TIMEOUT (seconds,
# default 480: fits one 10-minute device call). Exit status: the launch's.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/run_bench_megatron_memory.sh OUT_DIR [bench_megatron_memory.py options...]}
shift
py=${PYTHON:-python3}
mkdir -p "$out"
timeout --signal=TERM --kill-after=15 "${LAUNCH_TIMEOUT:-480}" \
    $py -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    benchmarks/bench_megatron_memory.py --out "$out" "$@"
