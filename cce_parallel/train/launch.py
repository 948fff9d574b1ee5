"""Process setup: torchrun detection, device, environment, process groups and seeds.

``python -m cce_parallel.train`` is meant to run under torchrun. Started without it, a recipe
that needs one process runs in-process (world size 1); one that needs more re-executes itself
as ``python -m cce_parallel.train.torchrun --standalone --nproc-per-node N -m cce_parallel.train ...``
(torchrun, with an exit status for a stop on a signal: torchrun.py) with N = tensor · pipeline ·
(data or 1), and says so.
"""

import ctypes
import dataclasses
import datetime
import json
import os
import random
import signal
import socket
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

from cce_parallel.config import Recipe

# Launch settings of the CCE kernels for CPU runs (Triton interpreter): every program of the
# interpreter costs numpy calls, so large blocks (few programs) keep a tiny run to seconds per
# step, and chunk budgets that hold a whole micro-batch (smaller ones split the tokens into blocks,
# each a GEMM and a launch). Used when neither loss.kernel_config nor CCE_PARALLEL_KERNEL_CONFIG
# says otherwise.
CPU_KERNEL_CONFIG = {
    "fwd_block_n": 128, "fwd_block_v": 256, "fwd_programs": 1, "bwd_block_n": 128, "bwd_block_v": 256,
    "fwd_chunk_bytes": 64 << 20, "bwd_workspace_bytes": 64 << 20, "rows_block_n": 16, "rows_block_v": 1024,
    "probs_block_n": 256, "probs_block_v": 1024, "probs_block_d": 128, "probs_programs": 1,
}


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def resolve_device(recipe: Recipe) -> str:
    wanted = recipe.run.device
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        from cce_parallel.config import RecipeError

        raise RecipeError("run.device: cuda, but torch sees no CUDA device (use run.device=auto or cpu)")
    return wanted


def check_gpus(device: str, per_node: int):
    """RecipeError where this node would start more processes than it has GPUs: each rank takes
    the GPU of its local rank, and one past the last would fail with "invalid device ordinal"."""
    if device != "cuda" or per_node <= torch.cuda.device_count():
        return
    from cce_parallel.config import RecipeError

    count = torch.cuda.device_count()
    raise RecipeError(
        f"run.device: cuda, {per_node} processes on this node (one GPU each), but torch sees {count} CUDA "
        f"device(s): start at most {count} per node (torchrun --nproc-per-node={count}), or set run.device=cpu"
    )


def needed_world_size(recipe: Recipe) -> int:
    p = recipe.parallel
    return p.tensor * p.pipeline * (p.data or 1)


def relaunch(nproc: int, argv: list[str]):
    """Replace this process by torchrun (through cce_parallel.train.torchrun: its exit status and
    grace) starting nproc copies of the entry point (no return)."""
    cmd = [sys.executable, "-m", "cce_parallel.train.torchrun", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "cce_parallel.train", *argv]
    print(f"not under torchrun: this recipe needs {nproc} processes; running\n  {' '.join(cmd)}", flush=True)
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def prepare_environment(recipe: Recipe, device: str):
    """What must be set before megatron-core (which imports triton) is imported."""
    if device == "cpu":
        # The CCE kernels run on CPU tensors only under the Triton interpreter, which triton
        # reads when it is first imported.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            # Set now, the kernels would fail (ops/functional.py raises): torch's ops instead.
            warnings.warn("triton was imported before TRITON_INTERPRET=1 could be set: CCE falls back to torch")
        else:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        # All ranks of a CPU run are on this host: gloo over loopback, whatever the hostname resolves to.
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if device == "cuda" and recipe.parallel.fsdp == "megatron":
        # Megatron-FSDP overlaps its gathers and reduce-scatters with compute on side streams,
        # which one hardware queue would serialize; Megatron-LM refuses the setting with it.
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            warnings.warn("parallel.fsdp=megatron: CUDA_DEVICE_MAX_CONNECTIONS=1 (launch/env.sh, the image) is "
                          "dropped for this run; Megatron-FSDP needs more than one hardware queue")
            del os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]
    elif device == "cuda":
        # Megatron-LM's setting: one hardware queue, so that tensor-parallel communication issued
        # before a GEMM is scheduled before it (megatron warns without it).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if device == "cuda":
        allocator_default()
        if recipe.train.deterministic:
            deterministic_environment()
    kernel_config = recipe.loss.kernel_config or (CPU_KERNEL_CONFIG if device == "cpu" else None)
    if kernel_config and "CCE_PARALLEL_KERNEL_CONFIG" not in os.environ:
        check_kernel_config(kernel_config)
        os.environ["CCE_PARALLEL_KERNEL_CONFIG"] = json.dumps(kernel_config)


# The caching allocator's default for training: expandable segments grow one mapping instead of
# carving fixed blocks, so memory freed between micro-batches of other sizes is reused. Without it,
# Megatron's loss at micro-batch 24 with full recomputation (Gemma 2 2B, H200) peaked at 93 of
# 141 GiB at step 1 and then stalled in the allocator; with it the run trained at 85k tokens/s.
ALLOCATOR_DEFAULT = "expandable_segments:True"


def allocator_default() -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF to ALLOCATOR_DEFAULT unless the user set it (or torch's newer
    name, PYTORCH_ALLOC_CONF); must run before CUDA is initialized. Returns the line to log."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if os.environ.get(name):
            line = f"allocator: {name}={os.environ[name]} (set by the user)"
            break
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_DEFAULT
        line = f"allocator: PYTORCH_CUDA_ALLOC_CONF={ALLOCATOR_DEFAULT} (the train job's default; set it to override)"
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)
    return line


def deterministic_environment():
    """What train.deterministic needs before CUDA and NCCL start: cuBLAS's fixed workspace (torch
    refuses deterministic GEMMs without it) and one NCCL algorithm, Ring: NCCL may otherwise pick
    per call among algorithms (NVLS among them) whose reduction orders differ. The user's values win."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")


def deterministic_kernels():
    """torch's deterministic kernels (train.deterministic): an op with only a nondeterministic
    CUDA kernel raises instead of running. The embedding's backward then sorts its indices instead
    of adding atomically, and SDPA's backward takes its deterministic form."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def check_kernel_config(fields: dict):
    """RecipeError unless the fields make a valid KernelConfig (imports the kernels, hence triton)."""
    from cce_parallel.config import RecipeError
    from cce_parallel.kernels.config import KernelConfig

    try:
        dataclasses.replace(KernelConfig(), **fields)
    except (TypeError, ValueError) as err:
        known = ", ".join(f.name for f in dataclasses.fields(KernelConfig))
        raise RecipeError(f"loss.kernel_config: {err} (fields: {known})") from None


def quiet_warnings():
    """megatron-core warns at import that TE and apex (0.19: also absl) are missing; it falls back."""
    for message in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated",
                    "absl.logging is not installed",
                    ".*set the environment variable CUDA_DEVICE_MAX_CONNECTIONS"):
        warnings.filterwarnings("ignore", message=message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(recipe: Recipe, device: str) -> dict:
    """Join the process group and megatron-core's parallel groups; seed every RNG.

    Called again in the same process (the tests run several layouts per launch), it keeps the
    process group and builds megatron-core's groups for the new recipe's layout.
    Returns the layout: rank, world, local_rank, tp, pp, dp, dp_rank, accumulation.
    """
    from megatron.core import parallel_state

    if under_torchrun():
        exit_with_launcher()
    else:  # a plain start that needs one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dp, accumulation = recipe.check_world(world, device)  # before any collective: every rank raises
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        # Ranks share the host's cores.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
    else:
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            timeout=datetime.timedelta(minutes=recipe.run.dist_timeout_minutes),
        )
    p = recipe.parallel
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline)
    _seed(recipe.run.seed, device)
    if recipe.train.deterministic:
        deterministic_kernels()
    return {
        "rank": dist.get_rank(), "world": world, "local_rank": local_rank, "tp": p.tensor, "pp": p.pipeline,
        "dp": dp, "dp_rank": parallel_state.get_data_parallel_rank(), "accumulation": accumulation,
    }


def exit_with_launcher():
    """Have the kernel SIGKILL this worker when its parent (torchrun's agent) exits (Linux).

    torchrun stops its workers when it is stopped, but a SIGKILLed torchrun (a node's OOM killer,
    `kill -9`, a lost SLURM step) cannot: its workers would run on, holding GPUs and the run
    directory, and writing checkpoints beside the restarted run.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        warnings.warn(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): workers outlive a killed torchrun")
    elif os.getppid() != parent:  # the launcher died before the call
        os._exit(1)


def _seed(seed: int, device: str):
    """Megatron-LM's seeding: seed + 100 · pipeline rank for python/numpy/torch, and on CUDA the
    tensor-parallel RNG tracker (distinct streams per TP rank for dropout inside TP regions)."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown():
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
