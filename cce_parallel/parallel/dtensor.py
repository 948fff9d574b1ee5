"""DTensor inputs of linear_cross_entropy: the tensor-parallel layout read off the placements.

A classifier c that is a DTensor Shard(0) on one mesh dimension (Replicate on the others) is a
vocabulary shard per rank of that dimension: the loss runs with tp_group = mesh.get_group(dim) and
vocab_range = this rank's rows. DTensor splits V rows as torch.chunk does: ceil(V / n) rows per rank,
the last ranks taking what is left (fewer, possibly none). A c that is Replicate on every mesh
dimension is a plain, whole classifier.

e may be a DTensor on c's mesh: Replicate (every rank holds all tokens), or Shard(0) on c's
tensor-parallel dimension (each rank holds a slice of the tokens along dim 0, Megatron's sequence
parallelism). targets hold all tokens: a plain tensor, or a DTensor that is gathered.

Autograd goes through to_local(), whose backward wraps each local gradient back into a DTensor with
the input's mesh and placements, so ∇c and ∇bias come back as DTensors sharded like c and ∇e like e.
The loss (and lse) are plain tensors, identical on every rank of the tensor-parallel group.
"""

import sys
from typing import NamedTuple

import torch
import torch.distributed as dist

# torch.distributed.tensor is imported only once a DTensor is seen (it adds ~0.6 s to an import).


class Unwrapped(NamedTuple):
    e: torch.Tensor
    c: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None
    tp_group: dist.ProcessGroup | None
    vocab_range: tuple[int, int] | None
    sequence_parallel: bool
    error: ValueError | None  # this rank's own input error, raised once every rank has reported


def any_dtensor(*tensors) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # not imported yet: no DTensor exists
    return module is not None and any(isinstance(t, module.DTensor) for t in tensors)


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of `size` rows that part `index` of `parts` holds under torch.chunk
    (DTensor's Shard): ceil(size / parts) per part, the last parts get fewer or none."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def _describe(t) -> str:
    return f"placements {tuple(t.placements)} on mesh {tuple(t.device_mesh.mesh_dim_names or ())} {tuple(t.device_mesh.shape)}"


def _tp_dim(c) -> int | None:
    """The mesh dimension c is Shard(0) on, or None where c is Replicate everywhere."""
    from torch.distributed.tensor import Replicate, Shard

    shard_dims = []
    for dim, p in enumerate(c.placements):
        if isinstance(p, Replicate):
            continue
        if isinstance(p, Shard) and type(p) is Shard and p.dim == 0:
            shard_dims.append(dim)
            continue
        raise ValueError(
            f"c as a DTensor must be Shard(0) (vocabulary rows) or Replicate on each mesh dimension; "
            f"got {p} on mesh dimension {dim} ({_describe(c)})"
        )
    if len(shard_dims) > 1:
        raise ValueError(
            f"c as a DTensor may be Shard(0) on one mesh dimension only (the tensor-parallel one); "
            f"got mesh dimensions {shard_dims} ({_describe(c)})"
        )
    return shard_dims[0] if shard_dims else None


def _check_same_mesh(name: str, t, c):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and t.device_mesh != c.device_mesh:
        raise ValueError(
            f"{name} and c are DTensors on different meshes: {name} on {t.device_mesh}, c on {c.device_mesh}"
        )


def unwrap(e, c, targets, bias, tp_group, vocab_range, sequence_parallel) -> Unwrapped:
    """Local tensors and the tensor-parallel layout for inputs of which at least one is a DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(c, DTensor):
        raise TypeError(
            "e, targets or bias is a DTensor but c is not: pass c as a DTensor too (Shard(0) on the "
            "tensor-parallel mesh dimension, or Replicate)"
        )
    _check_same_mesh("e", e, c)
    _check_same_mesh("bias", bias, c)
    mesh = c.device_mesh
    dim = _tp_dim(c)

    if isinstance(bias, DTensor) and tuple(bias.placements) != tuple(c.placements):
        raise ValueError(
            f"bias must be placed like c: bias has {tuple(bias.placements)}, c has {tuple(c.placements)}"
        )

    sp = False
    if isinstance(e, DTensor):
        for d, p in enumerate(e.placements):
            if isinstance(p, Replicate):
                continue
            if d == dim and type(p) is Shard and p.dim == 0:
                sp = True
                continue
            where = (
                "c's tensor-parallel mesh dimension" if d == dim else "a mesh dimension c is not sharded on"
            )
            hint = ""
            if d == dim and type(p) is Shard and 0 < p.dim < e.dim() - 1:
                hint = f"; move the sharded token dimension first, e.g. e.transpose(0, {p.dim}) and targets alike"
            raise ValueError(
                f"e as a DTensor must be Replicate, or Shard(0) (tokens, sequence parallel) on c's "
                f"tensor-parallel mesh dimension; got {p} on mesh dimension {d}, {where} ({_describe(e)}){hint}"
            )
        if sequence_parallel and not sp:
            raise ValueError(
                "sequence_parallel=True, but e is a DTensor that is not Shard(0) on c's tensor-parallel mesh dimension"
            )
        if sp and e.shape[0] % mesh.size(dim):
            raise ValueError(
                f"sequence parallel e must split evenly: e.shape[0] = {e.shape[0]} is not divisible by the "
                f"{mesh.size(dim)} ranks of mesh dimension {dim}"
            )
        sequence_parallel = sp
        e = e.to_local()
    if isinstance(targets, DTensor):
        if any(not isinstance(p, (Replicate, Shard)) for p in targets.placements):
            raise ValueError(f"targets as a DTensor must be Replicate or Shard; got {_describe(targets)}")
        targets = targets.full_tensor()

    if isinstance(bias, DTensor):
        bias = bias.to_local()
    if dim is None:
        if tp_group is not None or vocab_range is not None or sequence_parallel:
            raise ValueError(
                "c is a DTensor replicated on every mesh dimension (a whole classifier), which "
                "contradicts the tp_group, vocab_range or sequence_parallel given"
            )
        return Unwrapped(e, c.to_local(), targets, bias, None, None, False, None)

    group = mesh.get_group(dim)
    n = mesh.size(dim)
    index = mesh.get_local_rank(dim)
    derived = chunk_range(c.shape[0], n, index)
    # These depend on the rank: raising here would leave the other ranks waiting in a collective.
    error = None
    if derived[0] == derived[1]:
        error = ValueError(
            f"c's Shard(0) gives this rank no rows: V = {c.shape[0]} rows over {n} ranks in chunks of "
            f"{-(-c.shape[0] // n)}; empty vocabulary shards are not supported (choose V so that every "
            f"rank gets rows, e.g. a multiple of {n})"
        )
    elif tp_group is not None and (given := dist.get_process_group_ranks(tp_group)) != (
        ranks := dist.get_process_group_ranks(group)
    ):
        error = ValueError(
            f"tp_group (ranks {given}) disagrees with c's DTensor, which is sharded over ranks {ranks} "
            f"(mesh dimension {dim})"
        )
    elif vocab_range is not None and tuple(vocab_range) != derived:
        error = ValueError(
            f"vocab_range {tuple(vocab_range)} disagrees with c's DTensor shard on this rank, rows {derived}"
        )
    return Unwrapped(e, c.to_local(), targets, bias, group, derived, sequence_parallel, error)
