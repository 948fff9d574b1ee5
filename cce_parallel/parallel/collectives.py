"""The collectives of a tensor-parallel group, in plain eager code with an explicit ProcessGroup
(so they run on gloo in CPU tests and on NCCL on GPUs)."""

import torch
import torch.distributed as dist

from cce_parallel.ops.common import Collectives

# torch >= 2.13 renames the tensor-in/tensor-out collectives; 2.6-2.12 only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class GroupCollectives(Collectives):
    """Collectives over `group`, the ranks that share one vocabulary (rank r holds shard r)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.first = self.rank == 0

    def all_max_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def all_sum_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] * self.world, *x.shape[1:]))
        _all_gather(out, x.contiguous(), group=self.group)
        return out

    def sum_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0] // self.world, *x.shape[1:]))
        _reduce_scatter(out, x.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
        return out
