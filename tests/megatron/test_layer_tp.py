"""CCEOutputLayer in a tensor-parallel group of 2 (gloo, CPU): labels outside the vocabulary on ONE
rank only raise ValueError on every rank, with and without sequence parallelism, on the one-pass
and the PyTorch path; the group is usable afterwards.

Before every rank learned every rank's count of bad labels, only the rank holding the bad label
raised; the other went on into its next collective (here the barrier after each case) and waited
there until the group's timeout, which is short here so that the test fails rather than hangs.
(tests/parallel/test_vocab_parallel.py covers every path of the loss itself.)
"""

import re

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn

pytestmark = pytest.mark.distributed

S, B, H, V = 6, 2, 16, 32  # two vocabulary shards of 16 rows; tiny: the interpreter is slow

# name -> (impl, sequence_parallel, {rank: (b, s, label)}); -100 is ignore_index
CASES = {
    "one-pass-sp-too-large": ("cce_kahan_full_c", True, {1: (0, 4, V)}),
    "one-pass-negative": ("cce_kahan_full_c", False, {0: (1, 2, -5)}),
    "torch-sp-negative": ("torch", True, {0: (1, 5, -1)}),
    "torch-too-large": ("torch", False, {1: (0, 0, V + 3)}),
}


def _layers(group):
    from megatron.core.model_parallel_config import ModelParallelConfig

    from cce_parallel.megatron import CCEOptions, CCEOutputLayer

    layers = {}
    for impl in ("cce_kahan_full_c", "torch"):
        for sp in (False, True):
            config = ModelParallelConfig(
                use_cpu_initialization=True,
                params_dtype=torch.float32,
                tensor_model_parallel_size=2,
                sequence_parallel=sp,
            )
            torch.manual_seed(3)  # the same master weight on every rank, each taking its shard
            layers[impl, sp] = CCEOutputLayer(
                H, V, config=config, init_method=torch.nn.init.normal_, bias=False, tp_group=group,
                cce_options=CCEOptions(impl=impl),
            )
    return layers


def _worker(rank, world, report):
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's warnings about missing apex / TE
    group = dist.group.WORLD
    layers = _layers(group)
    for name, (impl, sp, bad) in [*CASES.items(), ("fine-after", ("cce_kahan_full_c", True, {}))]:
        report.started(name)
        g = torch.Generator().manual_seed(5)  # the same hidden states and labels on every rank
        hidden = torch.randn(S, B, H, generator=g)
        labels = torch.randint(0, V, (B, S), generator=g)
        if rank in bad:
            b, s, label = bad[rank]
            labels[b, s] = label
        if sp:
            hidden = hidden[rank * S // world:(rank + 1) * S // world]
        hidden.requires_grad_()
        try:
            loss, _ = layers[impl, sp](hidden, labels=labels)
            loss.sum().backward()
            outcome = ("no error", tuple(loss.shape))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            outcome = (type(exc).__name__, str(exc))
        report.result(name, outcome)
        dist.barrier(group)  # the next collective: a rank left behind times out here


_OUTCOME = []


def _outcome():
    if not _OUTCOME:
        _OUTCOME.append(spawn(_worker, 2, timeout=300.0, collective_timeout=20.0, grace=5.0))
    return _OUTCOME[0]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_label_on_one_rank_raises_on_every_rank(name):
    _, _, bad = CASES[name]
    outcome = _outcome()
    per_rank = outcome.merged().get(name, {})
    problems = []
    for rank in range(2):
        if rank not in per_rank:
            problems.append(f"rank {rank}: no outcome (hung or died before this case)")
            continue
        kind, msg = per_rank[rank]
        if rank in bad:  # names the label
            want = rf"\[0, {V}\) or equal ignore_index=-100; found {bad[rank][2]} \(1 such targets"
        else:  # names the rank that has it
            want = rf"\[0, {V}\) or equal ignore_index=-100; tensor-parallel rank\(s\) \[{min(bad)}\] have 1 "
        if kind != "ValueError":
            problems.append(f"rank {rank}: expected ValueError, got {kind}: {msg}")
        elif not re.search(want, msg):
            problems.append(f"rank {rank}: ValueError message {msg!r} does not match {want!r}")
    if problems:
        pytest.fail(f"{name}:\n" + "\n".join(problems) + "\n" + outcome.describe(), pytrace=False)


def test_layer_usable_after_bad_labels():
    outcome = _outcome()
    per_rank = outcome.merged().get("fine-after", {})
    assert outcome.ok and sorted(per_rank) == [0, 1], outcome.describe()
    assert all(per_rank[r] == ("no error", (B, S)) for r in per_rank), per_rank
