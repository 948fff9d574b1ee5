#!/usr/bin/env bash
# Train on one node: torchrun --standalone, one process per GPU (or CPU processes over gloo).
#
#   launch/train.sh NGPUS RECIPE [trainer arguments...]
#
#   launch/train.sh 8 recipes/<model>_<parallelism>_<hw>.yaml
#   launch/train.sh 4 recipes/x.yaml --set train.steps=200 --set optim.lr=3e-4
#   launch/train.sh cpu:2 recipes/tiny_cpu.yaml        # CPU, 2 processes, gloo
#
# NGPUS
#   N        N processes, one per GPU (the first N that CUDA_VISIBLE_DEVICES shows).
#   gpu      one process per visible GPU (torchrun counts them).
#   cpu[:N]  N processes on the CPU (default 1): CUDA_VISIBLE_DEVICES is emptied, so the trainer
#            sees no GPU and uses gloo; CCE_PARALLEL_DEVICE=cpu is exported as well. The CCE
#            kernels then run under the Triton interpreter only with TRITON_INTERPRET=1 (slow);
#            otherwise the loss falls back to its PyTorch implementation.
#
# Runs: python -m cce_parallel.train.torchrun --standalone --nnodes 1 --nproc-per-node NGPUS
#       -m cce_parallel.train --recipe RECIPE ...
# (torchrun's agent with the job's exit status and grace: cce_parallel/train/torchrun.py). The
# arguments after RECIPE go to the trainer unchanged.
#
# Exit status: 0 when the run finished, or when every rank saved a checkpoint and stopped on a
# signal (SIGTERM, SIGUSR1 to this process or its group) or at train.exit_duration: start the same
# command again to resume; 2 for a bad recipe or data; 128 + N when signal N stopped the run
# without a checkpoint from every rank; 1 for any other failure.
#
# Environment: see launch/env.sh (CUDA_DEVICE_MAX_CONNECTIONS=1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
# OMP_NUM_THREADS, NCCL_*). One node needs no NCCL network settings: GPUs talk over NVLink / PCIe.
#   TORCHRUN=torchrun                             another agent (default: $PYTHON -m cce_parallel.train.torchrun)
#   PYTHON=/path/to/python                        the Python (default: python on PATH, else python3)
#   CCE_DRY_RUN=1                                 print the command and exit
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

[ $# -ge 2 ] || usage
case "$1" in -h | --help) usage ;; esac
ngpus="$1"
recipe="$2"
shift 2

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/env.sh
source "$here/env.sh"
cce_check_recipe "$recipe"

case "$ngpus" in
    cpu | cpu:*)
        nproc_per_node="${ngpus#cpu}"
        nproc_per_node="${nproc_per_node#:}"
        nproc_per_node="${nproc_per_node:-1}"
        export CUDA_VISIBLE_DEVICES=""
        export CCE_PARALLEL_DEVICE=cpu
        # All ranks are on this host: gloo talks over loopback unless told otherwise.
        if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && [ -e /sys/class/net/lo ]; then
            export GLOO_SOCKET_IFNAME=lo
        fi
        ;;
    gpu)
        nproc_per_node=gpu
        ;;
    *)
        nproc_per_node="$ngpus"
        ;;
esac
if [ "$nproc_per_node" != gpu ] && ! [[ "$nproc_per_node" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPUS must be a positive number, 'gpu', 'cpu' or 'cpu:N'; got '$ngpus'" >&2
    exit 2
fi

if [ "$nproc_per_node" = gpu ]; then
    cce_env_defaults "$(cce_count_gpus)"
else
    cce_env_defaults "$nproc_per_node"
fi
cce_torchrun
cce_run "${CCE_TORCHRUN[@]}" --standalone --nnodes 1 --nproc-per-node "$nproc_per_node" \
    -m cce_parallel.train --recipe "$recipe" "$@"
