#!/usr/bin/env bash
# Train on several nodes: run this same command on every node (by hand, pdsh, or your scheduler).
#
#   launch/multinode.sh NNODES NGPUS_PER_NODE HOST:PORT RECIPE [trainer arguments...]
#
#   # on each of 4 nodes, node0 being reachable from all of them:
#   launch/multinode.sh 4 8 node0:29500 recipes/x.yaml --set train.steps=1000
#
# Runs: python -m cce_parallel.train.torchrun --nnodes NNODES --nproc-per-node NGPUS_PER_NODE
#       --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id $RDZV_ID -m cce_parallel.train --recipe RECIPE ...
# (torchrun's agent with the job's exit status and grace, as launch/train.sh says; each node's
# command exits 0 when its ranks saved and stopped on a signal).
#
# Rendezvous: the node whose address is HOST hosts the c10d store on PORT (open that TCP port
# between the nodes); node ranks are assigned as nodes join, so no node needs its rank. NNODES
# may be a range MIN:MAX for elastic starts. Every node must give the same RDZV_ID (default:
# cce-<recipe name>; set a fresh one, e.g. a job id, when an old job may still be running).
#
# After a failure (a node lost, a rank killed: with MAX_RESTARTS=0 the other agents stop too, at
# the latest when a collective times out), run the same command again on every node: the store
# lived in an agent that has exited, so the same RDZV_ID starts a fresh rendezvous, and the run
# resumes from its newest checkpoint (the train job's checkpoint.resume: auto).
# tests/e2e/test_multinode.py does this with two agents on one host.
#
# The data directory (with its megatron_cache/) and the run directory must be on a filesystem
# all nodes share: global rank 0 builds the sample indices, the other ranks read them.
#
# Environment: launch/env.sh sets CUDA_DEVICE_MAX_CONNECTIONS=1, TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
# NCCL_DEBUG=WARN, OMP_NUM_THREADS and torchrun's signal forwarding (SIGUSR1 included; 300 s
# before SIGKILL), and lists what to export for your network, mainly:
#   NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME   the interface that reaches the other nodes
#   NCCL_IB_HCA, NCCL_IB_GID_INDEX            InfiniBand / RoCE adapters; NCCL_IB_DISABLE=1 for TCP only
# Also:
#   RDZV_ID          rendezvous id (see above)
#   RDZV_CONF        extra --rdzv-conf, e.g. join_timeout=1800 for slow node starts
#   MAX_RESTARTS     torchrun --max-restarts (default 0: fail fast)
#   TORCHRUN         another agent, e.g. torchrun (default: $PYTHON -m cce_parallel.train.torchrun)
#   PYTHON           the Python (default: python on PATH, else python3)
#   CCE_DRY_RUN=1    print the command and exit
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

[ $# -ge 4 ] || usage
nnodes="$1"
ngpus="$2"
endpoint="$3"
recipe="$4"
shift 4

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=launch/env.sh
source "$here/env.sh"
cce_check_recipe "$recipe"

if ! [[ "$nnodes" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]]; then
    echo "error: NNODES must be a positive number or MIN:MAX; got '$nnodes'" >&2
    exit 2
fi
if ! [[ "$ngpus" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: NGPUS_PER_NODE must be a positive number; got '$ngpus'" >&2
    exit 2
fi
if ! [[ "$endpoint" =~ ^[^:]+:[0-9]+$ ]]; then
    echo "error: the rendezvous endpoint must be HOST:PORT; got '$endpoint'" >&2
    exit 2
fi

recipe_name="$(basename "$recipe")"
rdzv_id="${RDZV_ID:-cce-${recipe_name%.*}}"
cce_env_defaults "$ngpus"
cce_torchrun
args=(--nnodes "$nnodes" --nproc-per-node "$ngpus" --rdzv-backend c10d --rdzv-endpoint "$endpoint"
    --rdzv-id "$rdzv_id" --max-restarts "${MAX_RESTARTS:-0}")
if [ -n "${RDZV_CONF:-}" ]; then
    args+=(--rdzv-conf "$RDZV_CONF")
fi
cce_run "${CCE_TORCHRUN[@]}" "${args[@]}" -m cce_parallel.train --recipe "$recipe" "$@"
