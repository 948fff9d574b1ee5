"""How the vocabulary is split over a tensor-parallel group, agreed on by all ranks.

One all-gather of a few integers per call checks that every rank got consistent inputs. A rank
whose own inputs are malformed still takes part before raising, so the others raise too instead
of hanging in a later collective.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from cce_parallel.parallel.collectives import _all_gather

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclass(frozen=True)
class VocabLayout:
    """This rank's rows [start, stop) of a vocab_size vocabulary, in a group of `world` ranks;
    largest_shard: the most rows any rank holds."""

    rank: int
    world: int
    start: int
    stop: int
    vocab_size: int
    largest_shard: int


def _meta_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_layout(
    group: dist.ProcessGroup,
    e,
    c,
    targets,
    vocab_range: Optional[Tuple[int, int]],
    sequence_parallel: bool,
    local_error: Optional[Exception],
) -> VocabLayout:
    """All-gather each rank's shapes and vocabulary range; raise ValueError on any disagreement.

    local_error is this rank's own input error (raised here, after the others have heard of it).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ok = local_error is None
    start, stop = vocab_range if (ok and vocab_range is not None) else (-1, -1)
    fields = [
        int(ok),
        c.shape[0] if ok else -1,
        start,
        stop,
        e.shape[-1] if ok else -1,
        e.shape[0] if ok and e.dim() > 1 else -1,
        targets.numel() if ok else -1,
        _DTYPES.get(e.dtype, -1) if ok else -1,
        int(sequence_parallel),
    ]
    mine = torch.tensor(fields, dtype=torch.int64, device=_meta_device(group))
    table = torch.empty(world * len(fields), dtype=torch.int64, device=mine.device)
    _all_gather(table, mine, group=group)
    rows = table.view(world, len(fields)).tolist()
    if local_error is not None:
        raise local_error
    bad = [r for r, row in enumerate(rows) if not row[0]]
    if bad:
        raise ValueError(f"tensor-parallel rank(s) {bad} rejected their inputs; see the error on those ranks")
    for col, what in ((4, "hidden size D"), (5, "rows of e"), (6, "number of targets"), (7, "dtype"), (8, "sequence_parallel")):
        values = [row[col] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"tensor-parallel ranks disagree on {what}: {values} (rank order)")

    sizes = [row[1] for row in rows]
    ranges = [(row[2], row[3]) for row in rows]
    given = [r != (-1, -1) for r in ranges]
    if any(given) and not all(given):
        raise ValueError("vocab_range must be given on every tensor-parallel rank or on none")
    if not any(given):
        if len(set(sizes)) > 1:
            raise ValueError(
                f"default vocabulary shards are equal, but the ranks' classifier shards have {sizes} rows; "
                "pass vocab_range=(start, stop) for uneven shards"
            )
        ranges = [(r * sizes[0], (r + 1) * sizes[0]) for r in range(world)]
    for r, ((lo, hi), n) in enumerate(zip(ranges, sizes)):
        if hi - lo != n:
            raise ValueError(f"rank {r}: vocab_range {(lo, hi)} has {hi - lo} rows but its classifier shard has {n}")
    expect = 0
    for lo, hi in sorted(ranges):
        if lo != expect:
            raise ValueError(f"vocabulary shards {sorted(ranges)} do not tile [0, V): gap or overlap at {expect}")
        expect = hi
    return VocabLayout(
        rank=rank, world=world, start=ranges[rank][0], stop=ranges[rank][1], vocab_size=expect,
        largest_shard=max(sizes),
    )
