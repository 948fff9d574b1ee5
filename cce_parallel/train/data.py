"""Data for the trainer: the prepared dataset, megatron GPT datasets, and deterministic batches.

The position in the data is one number, the samples consumed so far: step k's global batch is
samples [k·G, (k+1)·G) of the (shuffled, epoch-repeated) GPTDataset, G = train.global_batch_size.
Within it, micro-batch m of data-parallel rank r is the slice starting at (m·dp + r)·mb, as
Megatron's MegatronPretrainingSampler lays it out. A resumed run therefore reads exactly the
batches the uninterrupted run would have read. Evaluation always reads the first
eval.iters · G validation samples, so that validation losses are comparable across evaluations.
"""

import contextlib
import logging
import sys

import torch
import torch.distributed as dist

from cce_parallel.config import DataConfig, Recipe


def prepare(data: DataConfig):
    """Prepare (or find) the dataset of a recipe; idempotent. Returns its DatasetInfo. The first
    time it tokenizes for a while (the tiny recipe's: about 10 s on two cores); its progress goes
    to stdout."""
    from cce_parallel.data import prepare_dataset

    with _progress_on_stdout():
        return prepare_dataset(
            data.source,
            data.resolved_dir(),
            tokenizer=data.tokenizer,
            vocab_size=data.vocab_size,
            valid_fraction=data.valid_fraction,
            seed=data.seed,
            max_documents=data.max_documents,
        )


@contextlib.contextmanager
def _progress_on_stdout():
    """The data package's log lines (what is read, trained, tokenized: counts and times) on stdout,
    as "data: ...", while the block runs; the logger is as it was afterwards."""
    log = logging.getLogger("cce_parallel.data")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("data: %(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # not twice where the root logger has a console handler too
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def prepare_on_rank0(data: DataConfig):
    """Rank 0 prepares the dataset while the others wait; then every rank loads its info."""
    from cce_parallel.data import DataError, load_dataset_info

    error = None
    if dist.get_rank() == 0:
        try:
            prepare(data)
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            error = err
    # [failed, the message of a DataError]: bad data is one line from rank 0, not a traceback per rank
    failed = [error is not None, str(error) if isinstance(error, DataError) else None]
    dist.broadcast_object_list(failed, src=0)
    if error is not None:
        raise error
    if failed[1] is not None:
        raise DataError(failed[1])
    if failed[0]:
        raise RuntimeError(f"rank 0 failed to prepare the dataset in {data.resolved_dir()} (see its log)")
    return load_dataset_info(data.resolved_dir())


class Batches:
    """Micro-batches of this data-parallel rank, addressed by step (see the module doc)."""

    def __init__(self, dataset, *, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int, device):
        self.dataset = dataset
        self.mb, self.gbs = micro_batch_size, global_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = device
        self.per_rank = global_batch_size // (micro_batch_size * dp_size)

    def microbatches(self, first_sample: int):
        """Iterator over this rank's micro-batches of the global batch starting at first_sample."""
        for m in range(self.per_rank):
            start = first_sample + (m * self.dp_size + self.dp_rank) * self.mb
            yield self._collate(range(start, start + self.mb))

    def _collate(self, indices):
        items = [self.dataset[i % len(self.dataset)] for i in indices]
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = torch.stack([torch.as_tensor(item[key]) for item in items])
        # Checked here, on the host's copy: the loss folds the mask into the labels (trainer.loss_func).
        mask = batch["loss_mask"]
        if not bool(((mask == 0) | (mask == 1)).all()):
            values = mask.unique().tolist()[:8]
            raise ValueError(f"the dataset's loss_mask must hold only 0 and 1, got {values}")
        return {key: t.to(self.device, non_blocking=True) for key, t in batch.items()}


def build_batches(recipe: Recipe, info, tokenizer, *, dp_rank: int, dp_size: int, device):
    """(train Batches, valid Batches) of the recipe on this rank."""
    from cce_parallel.data.megatron_data import build_gpt_datasets

    t = recipe.train
    train_ds, valid_ds = build_gpt_datasets(
        info,
        seq_length=recipe.model.seq_length,
        seed=recipe.data.seed,
        train_samples=t.steps * t.global_batch_size,
        valid_samples=recipe.eval.iters * t.global_batch_size,
        tokenizer=tokenizer,
        create_attention_mask=False,  # causal attention builds its own mask
    )
    kwargs = {"micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
              "dp_rank": dp_rank, "dp_size": dp_size, "device": device}
    return Batches(train_ds, **kwargs), Batches(valid_ds, **kwargs)
