# shellcheck shell=bash
# Environment shared by launch/train.sh, launch/multinode.sh and launch/slurm.sbatch (sourced).
#
# Every default below applies only where the variable is unset: whatever you export before
# launching wins, and settings of the host (for example NCCL_NVLS_ENABLE=0) are passed through.
#
# Set here, with defaults:
#   CUDA_DEVICE_MAX_CONNECTIONS=1      one hardware work queue per GPU, so kernels start in the
#                                      order they were issued. Megatron's tensor/sequence-parallel
#                                      communication overlap relies on it (a collective is
#                                      scheduled before the GEMM it overlaps); Megatron warns
#                                      under sequence parallelism without it.
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a failed or timed-out NCCL collective aborts the process
#                                      instead of hanging; torchrun then stops the other ranks.
#   NCCL_DEBUG=WARN                    NCCL prints its warnings (INFO shows the chosen transports:
#                                      check that IB/NVLink are used on a new cluster).
#   OMP_NUM_THREADS                    CPU threads per process: the node's cores (SLURM_CPUS_ON_NODE
#                                      under SLURM, else nproc) over its processes (torchrun would
#                                      otherwise set 1).
#   PYTHONUNBUFFERED=1                 logs of all ranks appear as they are written.
#   PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
#                                      the signals torchrun's agent catches and forwards to its
#                                      workers (torchrun --signals-to-handle): its default plus
#                                      SIGUSR1, which launch/slurm.sbatch has SLURM send before the
#                                      time limit and on which the train job saves and exits 0.
#                                      Not handled, SIGUSR1 would kill the agent, and the workers
#                                      die with their agent. (Not TORCHELASTIC_SIGNALS_TO_HANDLE:
#                                      torchrun overwrites that with this option's value. A torch
#                                      without the option forwards only its default four.)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300 seconds torchrun gives its workers after forwarding a
#                                      signal before it SIGKILLs them (default 30: too short for
#                                      the checkpoint save of a large model). A torch without
#                                      torchrun --shutdown-timeout ignores it and keeps 30. The
#                                      launchers' agent (python -m cce_parallel.train.torchrun)
#                                      waits longer where the job estimates its save needs it,
#                                      on any torch.
#
# Also read:
#   PYTHON                             the Python that runs the job (default: python on PATH, else python3)
#   TORCHRUN                           another agent, e.g. "torchrun" (default: $PYTHON -m cce_parallel.train.torchrun)
#
# Not set here; export them for your network (multi-node):
#   NCCL_SOCKET_IFNAME=eth0            interface for NCCL's bootstrap and socket transport (the one
#                                      that reaches the other nodes; never docker0 / lo).
#   GLOO_SOCKET_IFNAME=eth0            the same for gloo (the CPU variant, and torch's own barriers).
#   NCCL_IB_HCA=mlx5_0,mlx5_1          which InfiniBand / RoCE adapters to use (default: all).
#   NCCL_IB_DISABLE=1                  no InfiniBand: fall back to TCP sockets (slow, but works).
#   NCCL_IB_GID_INDEX=3                RoCE v2 usually needs the GID index of its IPv4 address.
#   NCCL_NET_GDR_LEVEL=PHB             how far GPUDirect RDMA may reach across the PCIe topology.
#   NCCL_NVLS_ENABLE=0                 turn NVLink SHARP (multicast) off where the host forbids it.
#   TORCH_NCCL_BLOCKING_WAIT, NCCL_TIMEOUT...: see the PyTorch and NCCL documentation.

cce_env_defaults() {
    # $1: the number of processes this node runs (for OMP_NUM_THREADS).
    local procs="${1:-1}" cores
    cores="${SLURM_CPUS_ON_NODE:-$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)}"
    if ! [[ "$procs" =~ ^[0-9]+$ ]] || [ "$procs" -lt 1 ]; then
        procs=1
    fi
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / procs > 0 ? cores / procs : 1 ))}"
    export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"
    export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"
}

cce_env_report() {
    # One line per setting the job relies on, for the log.
    local v
    for v in CUDA_VISIBLE_DEVICES CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG \
        OMP_NUM_THREADS NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA NCCL_IB_DISABLE NCCL_IB_GID_INDEX \
        NCCL_NVLS_ENABLE PET_SIGNALS_TO_HANDLE TORCH_ELASTIC_SHUTDOWN_TIMEOUT CCE_PARALLEL_DEVICE; do
        if [ -n "${!v+set}" ]; then
            echo "[launch] $v=${!v}"
        fi
    done
}

cce_run() {
    # Run (or, with CCE_DRY_RUN=1, print) a command, shell-quoted.
    local cmd
    cce_env_report
    cmd="$(printf '%q ' "$@")"
    echo "[launch] ${cmd% }"
    if [ "${CCE_DRY_RUN:-0}" = 1 ]; then
        return 0
    fi
    exec "$@"
}

cce_python() {
    # The Python that runs the job: $PYTHON if set, else python (or python3) on PATH.
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
    elif command -v python > /dev/null 2>&1; then
        echo python
    else
        echo python3
    fi
}

cce_torchrun() {
    # The torchrun command as an array: $TORCHRUN if set (e.g. "torchrun"), else the train job's
    # own (python -m cce_parallel.train.torchrun): torchrun's agent, which exits 0 when every rank
    # saved and stopped on a signal (torchrun: 1) and waits as long as that save needs before its
    # SIGKILL (cce_parallel/train/torchrun.py).
    if [ -n "${TORCHRUN:-}" ]; then
        read -r -a CCE_TORCHRUN <<< "$TORCHRUN"
    else
        CCE_TORCHRUN=("$(cce_python)" -m cce_parallel.train.torchrun)
    fi
}

cce_count_gpus() {
    # GPUs on this node according to nvidia-smi (at least 1).
    local n
    n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
}

cce_check_recipe() {
    if [ ! -f "$1" ]; then
        echo "error: recipe $1 does not exist" >&2
        exit 2
    fi
}
