"""CPU stand-ins for megatron-core's CUDA-only DDP, optimizer and no-pipeline schedule (gloo, fp32).

Each mirrors the piece it replaces (see engine.py), so that CPU runs train the same way:
- ``LocalDDP``: gradients averaged over the data-parallel group after the last micro-batch;
- ``LocalAdamW``: torch AdamW; weight decay off for biases and 1-D parameters (Megatron's
  ``wd_mult`` groups); the global gradient norm over the model-parallel group, counting
  parameters replicated across tensor-parallel ranks once (as ``param_is_not_tensor_parallel_duplicate``
  does), and clipping by clip_grad / (norm + 1e-6); under FSDP (engine.torch_fsdp, which replaces
  LocalDDP) the gradients are DTensor shards and their squares are summed over the data-parallel
  group too;
- ``forward_backward``: megatron's ``forward_backward_no_pipelining`` for a loss function that
  returns (loss sum, token count, report): each micro-batch loss is divided by its token count
  and by the number of micro-batches before its backward.
"""

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from torch.distributed.tensor import DTensor

from cce_parallel.config import OptimConfig


class LocalDDP(torch.nn.Module):
    """Averages gradients over the data-parallel group (megatron DDP's interface, no buckets)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad_buffer(self):
        for param in self.module.parameters():
            param.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def finish_grad_sync(self):
        if self.dp_size == 1:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp_size
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)


class LocalAdamW:
    """torch AdamW with Megatron's weight-decay groups and model-parallel gradient clipping."""

    def __init__(self, chunks: list, optim: OptimConfig, shard_group=None):
        decay, no_decay = [], []
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if param.requires_grad:
                    (no_decay if param.ndim == 1 or name.endswith(".bias") else decay).append(param)
        groups = [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
        )
        self.clip_grad = optim.clip_grad
        self.mp_group = parallel_state.get_model_parallel_group()
        self.shard_group = shard_group  # FSDP: the gradients are DTensors sharded over this group

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def scale_loss(self, loss):
        return loss

    def grad_norm(self) -> float:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        counted = [p.grad for p in params if param_is_not_tensor_parallel_duplicate(p)]
        square = torch.zeros((), dtype=torch.float32)
        for grad in counted:
            square += _local(grad).float().pow(2).sum()
        if self.shard_group is not None:
            dist.all_reduce(square, group=self.shard_group)
        dist.all_reduce(square, group=self.mp_group)
        return square.sqrt().item()

    @torch.no_grad()
    def step(self):
        """(update done, gradient norm before clipping, None) as MegatronOptimizer.step returns."""
        norm = self.grad_norm()
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                for group in self.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(coeff)
        self.optimizer.step()
        return True, norm, None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an FSDP gradient), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False, **_):
    """megatron-core's no-pipeline schedule for one model chunk (see the module doc)."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    reports = []
    for _i in range(num_microbatches):
        output, loss_func = forward_step_func(data_iterator, chunk)
        loss, num_tokens, report = loss_func(output)
        reports.append(report)
        if not forward_only:
            (loss / num_tokens.clamp(min=1) / num_microbatches).backward()
    if not forward_only:
        chunk.finish_grad_sync()
    return reports
