"""Model wrapping, optimizer and schedule: megatron-core's on CUDA, small stand-ins on CPU.

On CUDA, the run takes Megatron-LM's path: ``Float16Module`` (bf16), megatron-core's
``DistributedDataParallel`` (contiguous fp32 grad buffers, optional overlap), the optimizer from
``get_megatron_optimizer`` (fp32 main weights, optional DistributedOptimizer = ZeRO-1, gradient
clipping; apex FusedAdam where installed, otherwise torch's AdamW, switched to its fused kernel),
and the micro-batch/pipeline schedule of ``get_forward_backward_func``.

Those pieces allocate on CUDA unconditionally (grad buffers, found-inf flags, token counters,
clip norms), so a CPU run (gloo; tensor and data parallelism, fp32) uses the stand-ins of
``cpu.py`` with the same interfaces and the same arithmetic: the per-micro-batch loss divided
by its token count and by the number of micro-batches, gradients averaged over data-parallel
ranks, a global-norm clip that counts tensor-parallel duplicates once, and AdamW without weight
decay on biases and norms. Both paths use megatron-core's ``OptimizerParamScheduler``.

With ``parallel.fsdp: torch`` both paths wrap the model in megatron-core's
``TorchFullyShardedDataParallel`` (PyTorch FSDP2, see ``torch_fsdp``) instead of DDP / LocalDDP;
the optimizers then hold DTensor shards of the parameters and their states. With
``parallel.fsdp: megatron`` (CUDA) the model goes into Megatron-FSDP instead (``megatron_fsdp``).
"""

import copy
import dataclasses
import importlib.util
import math
from collections.abc import Callable

import torch
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from cce_parallel.config import Recipe, RecipeError


@dataclasses.dataclass
class Engine:
    """What a training step needs; ``model`` is the list of (wrapped) model chunks."""

    model: list
    optimizer: object  # .step() -> (ok, grad_norm, num_zeros), .zero_grad(), .param_groups, state dicts
    scheduler: OptimizerParamScheduler
    forward_backward: Callable  # get_forward_backward_func()'s signature
    kind: str  # "megatron" or "cpu"

    def zero_grad(self):
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train(self, mode: bool = True):
        for chunk in self.model:
            chunk.train(mode)


def build_engine(recipe: Recipe, model: torch.nn.Module, config, *, device: str, dtype: torch.dtype) -> Engine:
    if device == "cuda":
        chunks, optimizer, forward_backward = _megatron(recipe, model, config, dtype)
        kind = "megatron"
    else:
        from cce_parallel.train import cpu

        if recipe.parallel.fsdp == "torch":
            chunk = torch_fsdp(recipe, model, config)
            optimizer = cpu.LocalAdamW([chunk], recipe.optim, shard_group=chunk.process_group)
        else:
            chunk = cpu.LocalDDP(model)
            optimizer = cpu.LocalAdamW([chunk], recipe.optim)
        chunks, forward_backward = [chunk], cpu.forward_backward
        kind = "cpu"
    o = recipe.optim
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=recipe.decay_steps,
        lr_decay_style=o.schedule,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=recipe.train.steps,
        wd_incr_style="constant",
        # On resume the recipe's schedule wins over the checkpoint's (e.g. a run extended with
        # more train.steps); the checkpoint supplies the step count. Where the two differ the
        # trainer says so (schedule_change).
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    return Engine(chunks, optimizer, scheduler, forward_backward, kind)


# The scheduler's fields that shape the learning rate (its state dict's names), and the recipe keys
# that set them (build_engine).
SCHEDULE_KEYS = {"max_lr": "optim.lr", "min_lr": "optim.min_lr", "lr_warmup_steps": "optim.warmup_steps",
                 "lr_decay_steps": "optim.decay_steps", "lr_decay_style": "optim.schedule"}


@dataclasses.dataclass(frozen=True)
class ScheduleChange:
    """A resumed run whose learning-rate schedule is not the one its checkpoint was trained with."""

    step: int
    """The first step of the resumed run whose learning rate differs between the two."""
    changed: dict
    """{recipe key: (the checkpoint's value, the recipe's)} of the keys that differ."""
    lr_checkpoint: float
    """The learning rate of ``step`` under the checkpoint's schedule."""
    lr_recipe: float
    """... and under the recipe's, which the run uses."""
    decay_follows_steps: bool
    """optim.decay_steps is unset: the decay spans train.steps."""
    first: bool
    """``step`` is the resumed run's first step (the rates agree before it otherwise)."""

    @property
    def fix(self) -> str:
        """The overrides that give the checkpoint's schedule back."""
        return "--set " + " ".join(f"{key}={old}" for key, (old, _) in self.changed.items())

    def describe(self) -> str:
        changes = []
        for key, (old, new) in self.changed.items():
            follows = " (unset: it follows train.steps)" if key == "optim.decay_steps" and self.decay_follows_steps else ""
            changes.append(f"{key} {old} -> {new}{follows}")
        return (f"the learning-rate schedule differs from the one the checkpoint was trained with: {', '.join(changes)}. "
                f"Step {self.step}{'' if self.first else ' (the first whose rate differs)'} trains at lr "
                f"{self.lr_recipe:.3e} under the recipe's schedule (used), "
                f"{self.lr_checkpoint:.3e} under the checkpoint's; to keep the checkpoint's: {self.fix}")

    def to_json(self) -> dict:
        return {"changed": {k: list(v) for k, v in self.changed.items()}, "differs_at": self.step,
                "lr_checkpoint": self.lr_checkpoint, "lr_recipe": self.lr_recipe, "fix": self.fix}


def schedule_change(saved: dict, scheduler: OptimizerParamScheduler, recipe: Recipe) -> ScheduleChange | None:
    """Compare the scheduler state a checkpoint saved with the scheduler built from the recipe and
    restored from it (at the checkpoint's step): the first step of this run whose learning rate
    differs between the two, or None where none does (e.g. only min_lr changed under a constant
    schedule)."""
    changed = {key: (saved[field], getattr(scheduler, field))
               for field, key in SCHEDULE_KEYS.items() if field in saved and saved[field] != getattr(scheduler, field)}
    if not changed:
        return None
    old, new = copy.copy(scheduler), copy.copy(scheduler)  # get_lr reads these fields only
    for field in SCHEDULE_KEYS:
        if field in saved:
            setattr(old, field, saved[field])
    for step in range(scheduler.num_steps + 1, recipe.train.steps + 1):  # stops at once where the next differs
        old.num_steps = new.num_steps = step
        lr_old, lr_new = old.get_lr({}), new.get_lr({})
        if not math.isclose(lr_old, lr_new, rel_tol=1e-9, abs_tol=0.0):
            return ScheduleChange(step=step, changed=changed, lr_checkpoint=lr_old, lr_recipe=lr_new,
                                  decay_follows_steps=recipe.optim.decay_steps is None,
                                  first=step == scheduler.num_steps + 1)
    return None


def _megatron(recipe: Recipe, model, config, dtype):
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    p, o = recipe.parallel, recipe.optim
    model.cuda(torch.cuda.current_device())  # torch norms are built on the default device
    if dtype != torch.float32:
        model = Float16Module(config, model)
    if p.fsdp == "torch":
        chunks = [torch_fsdp(recipe, model, config)]
    elif p.fsdp == "megatron":
        chunks = [megatron_fsdp(model, config)]
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=p.overlap_grad_reduce,
            use_distributed_optimizer=p.distributed_optimizer,
        )
        chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        # Megatron-FSDP's shards are updated (and copied back into the bf16 weights) by the
        # distributed optimizer only.
        use_distributed_optimizer=p.distributed_optimizer or p.fsdp == "megatron",
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    if o.fused:
        _use_fused_adamw(optimizer)
    config.no_sync_func = chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return chunks, optimizer, get_forward_backward_func()


def torch_fsdp(recipe: Recipe, model: torch.nn.Module, config):
    """The model under megatron-core's TorchFullyShardedDataParallel: PyTorch FSDP2 over the
    data-parallel group, each parameter (a tensor-parallel shard) split along dim 0 across it.

    FSDP units: every TransformerLayer, the embedding unless the output layer shares its weight,
    and the root (the rest: final norm, output layer). A tied embedding stays in the root unit,
    which FSDP gathers before the forward and keeps gathered until the backward: the output layer
    then reads the whole weight, and both its gradients (lookup and loss) meet in one gradient
    before the reduce-scatter. In a unit of its own it would be resharded after its forward, and
    the loss would get the sharded DTensor. ColumnParallelLinear (megatron's default unit) is left
    out: inside a unit of local layers it would be wrapped twice.

    The CCE output layer needs nothing special: FSDP2 hands it the gathered weight as a plain
    tensor and reduce-scatters its .grad (gradient_accumulation_fusion is off, see gpt.py).
    megatron's wrapper builds its device mesh for "cuda"; for a model on the CPU it is built for
    "cpu", the one difference.
    """
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig
    from megatron.core.distributed import torch_fully_sharded_data_parallel as wrapper_module
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    units = {TransformerLayer, RotaryEmbedding}
    if not recipe.model.tie_embeddings:
        units.add(LanguageModelEmbedding)
    fsdp_config = TorchFullyShardedDataParallelConfig()  # reductions in the parameters' dtype
    mesh_class = wrapper_module.DeviceMesh
    if next(model.parameters()).device.type == "cpu":

        class _MeshOnCPU:
            @staticmethod
            def from_group(group, device_type):
                return mesh_class.from_group(group, "cpu")

        wrapper_module.DeviceMesh = _MeshOnCPU
    try:
        return _TorchFSDP(config, fsdp_config, model, sub_modules_to_wrap=units)
    finally:
        wrapper_module.DeviceMesh = mesh_class


def megatron_fsdp(model: torch.nn.Module, config):
    """The (Float16Module-wrapped, CUDA) model under megatron-core's Megatron-FSDP, ZeRO-3
    (``optim_grads_params``): every TransformerLayer a unit whose bf16 weights are gathered for its
    forward and backward and released after; the rest (embedding, tied or not, final norm and the
    output layer) is gathered from the forward until the gradients are reduced, so the CCE output
    layer reads its whole tensor-parallel shard as a plain tensor. Gradients are reduce-scattered
    in fp32 into fp32 shards, the optimizer updates fp32 main-weight shards and copies them into
    the bf16 weights. Tensor-parallel placements come from the parameters' megatron attributes
    (the output layer's are ColumnParallelLinear's). Gradient-accumulation fusion stays off (see
    gpt.py): Megatron-FSDP takes the output layer's gradient from .grad."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    if importlib.util.find_spec("einops") is None:
        raise RecipeError(
            "parallel.fsdp: megatron needs einops (pip install einops; the megatron extra has it)"
        )
    # fp32 gradient shards: 0.16 reads grad_reduce_in_fp32, 0.19 its own main-grads dtype (bf16 by default).
    fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    name = "megatron_fsdp_main_grads_dtype"
    grads = {name: torch.float32} if name in fields else {}
    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        grad_reduce_in_fp32=True,
        **grads,
    )
    return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)


class _TorchFSDP(TorchFullyShardedDataParallel):
    """megatron-core's wrapper, whose finish_grad_sync in 0.16 does not take the force_all_reduce
    that its own finalize_model_grads passes (0.19 adds it). FSDP2 reduce-scatters the gradients
    in the backward: there is nothing to finish."""

    def finish_grad_sync(self, force_all_reduce: bool = False):
        pass


def inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a (chained) megatron optimizer."""
    members = getattr(optimizer, "chained_optimizers", [optimizer])
    return [m.optimizer for m in members if getattr(m, "optimizer", None) is not None]


def _use_fused_adamw(optimizer):
    """Without apex/TE, megatron-core builds torch's AdamW with its default (foreach) kernels;
    its fused kernel takes the same state and hyperparameters, read per group at every step."""
    for inner in inner_optimizers(optimizer):
        if type(inner) is torch.optim.AdamW:
            inner.defaults.update(fused=True, foreach=False)
            for group in inner.param_groups:
                group.update(fused=True, foreach=False)
