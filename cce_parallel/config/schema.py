"""The recipe schema: one dataclass per YAML section, every field documented and checked.

The defaults are the ``tiny`` recipe (``recipes/tiny.yaml`` spells them out): a 2-layer GPT on
the offline stdlib text with a 1,024-token BPE, tensor parallel over 2 ranks, trained in about a
minute on a 2-core CPU. A recipe file holds what differs from these defaults.

Checks happen in three places, each naming the key it rejects:
- the loader (loader.py): unknown keys and wrong types;
- ``__post_init__`` of each section: a field's own range, and the sizes within a section;
- ``Recipe.__post_init__``: sizes across sections (heads % tp, batch sizes, ...), and
  ``Recipe.check_world(world_size, device)``: what needs the launch (tp·pp·dp = world size,
  CUDA-only features on CPU).

This module imports no torch and no kernels: a recipe validates anywhere.

The sections live by concept: section.py (``RecipeError`` and the ``Section`` base), model.py
(``model``, ``loss``, ``parallel``) and training.py (``run``, ``train``, ``optim``, ``data``,
``eval``, ``checkpoint``, ``logging``); this module puts them together into ``Recipe`` and holds
the checks across sections.
"""

import dataclasses
from dataclasses import dataclass, field

from cce_parallel.config.model import LossConfig, ModelConfig, ParallelConfig
from cce_parallel.config.section import RecipeError
from cce_parallel.config.training import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)


@dataclass
class Recipe:
    """A whole run. The defaults are the ``tiny`` recipe."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        m, p, t, o = self.model, self.parallel, self.train, self.optim
        if m.num_attention_heads % p.tensor:
            raise RecipeError(
                f"model.num_attention_heads: {m.num_attention_heads} heads do not split over parallel.tensor={p.tensor}"
            )
        if m.query_groups % p.tensor:
            raise RecipeError(
                f"model.num_query_groups: {m.query_groups} key/value heads do not split over parallel.tensor={p.tensor}"
            )
        if m.ffn_size % p.tensor:
            raise RecipeError(f"model.ffn_hidden_size: {m.ffn_size} does not split over parallel.tensor={p.tensor}")
        if m.num_layers % p.pipeline:
            raise RecipeError(
                f"model.num_layers: {m.num_layers} layers do not split over parallel.pipeline={p.pipeline} stages"
            )
        stage_layers = m.num_layers // p.pipeline
        if m.recompute_num_layers is not None and m.recompute_num_layers > stage_layers:
            raise RecipeError(
                f"model.recompute_num_layers: {m.recompute_num_layers} is more than the {stage_layers} layers "
                f"of a pipeline stage (model.num_layers={m.num_layers} / parallel.pipeline={p.pipeline})"
            )
        if p.sequence_parallel and m.seq_length % p.tensor:
            raise RecipeError(
                f"model.seq_length: {m.seq_length} does not split over parallel.tensor={p.tensor} "
                "(parallel.sequence_parallel)"
            )
        if p.data is not None:
            self.batch_layout(p.data)
        decay = o.decay_steps if o.decay_steps is not None else t.steps
        if o.warmup_steps >= decay and o.schedule != "constant":
            raise RecipeError(
                f"optim.warmup_steps: {o.warmup_steps} warmup steps leave no decay within "
                f"{'optim.decay_steps' if o.decay_steps is not None else 'train.steps'}={decay}"
            )
        if t.stop_at is not None and t.stop_at > t.steps:
            raise RecipeError(f"train.stop_at: {t.stop_at} is past train.steps={t.steps}")

    # -- sizes that depend on the launch -----------------------------------------------------

    def data_parallel_size(self, world_size: int) -> int:
        """parallel.data, or what the world size leaves for it; RecipeError if they disagree."""
        p = self.parallel
        model_parallel = p.tensor * p.pipeline
        if p.data is not None:
            if model_parallel * p.data != world_size:
                raise RecipeError(
                    f"parallel.data: tensor {p.tensor} x pipeline {p.pipeline} x data {p.data} = "
                    f"{model_parallel * p.data} ranks, but the world size is {world_size}"
                )
            return p.data
        if world_size % model_parallel:
            raise RecipeError(
                f"parallel.tensor: tensor {p.tensor} x pipeline {p.pipeline} = {model_parallel} does not "
                f"divide the world size {world_size}"
            )
        return world_size // model_parallel

    def batch_layout(self, dp: int) -> int:
        """Micro-batches per step per rank for data-parallel size dp; RecipeError if the sizes disagree."""
        t = self.train
        per_step = t.micro_batch_size * dp
        if t.grad_accumulation is not None:
            if per_step * t.grad_accumulation != t.global_batch_size:
                raise RecipeError(
                    f"train.global_batch_size: {t.global_batch_size} != micro_batch_size {t.micro_batch_size} "
                    f"x grad_accumulation {t.grad_accumulation} x data-parallel size {dp} = {per_step * t.grad_accumulation}"
                )
            return t.grad_accumulation
        if t.global_batch_size % per_step:
            raise RecipeError(
                f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size "
                f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}"
            )
        return t.global_batch_size // per_step

    def check_world(self, world_size: int, device: str) -> tuple[int, int]:
        """Check the recipe against the launch; return (data-parallel size, grad accumulation)."""
        dp = self.data_parallel_size(world_size)
        accumulation = self.batch_layout(dp)
        if device != "cuda":
            p = self.parallel
            for name, value, ok in (
                ("pipeline", p.pipeline, 1),
                ("sequence_parallel", p.sequence_parallel, False),
                ("distributed_optimizer", p.distributed_optimizer, False),
                ("overlap_grad_reduce", p.overlap_grad_reduce, False),
            ):
                if value != ok:
                    raise RecipeError(
                        f"parallel.{name}: {value!r} needs CUDA (megatron-core's implementation allocates on "
                        f"the GPU); on CPU use parallel.{name}={ok!r}"
                    )
            if p.fsdp == "megatron":
                raise RecipeError(
                    "parallel.fsdp: megatron (Megatron-FSDP) needs CUDA (it runs its gathers and reduce-scatters "
                    "on CUDA streams); on CPU use parallel.fsdp=torch"
                )
            if self.train.precision == "bf16":
                raise RecipeError("train.precision: bf16 needs CUDA (the Triton interpreter on CPU is fp32 only)")
            if self.model.attention == "te":
                raise RecipeError("model.attention: te (Transformer Engine) needs CUDA; use sdpa or auto")
            if self.loss.fusion_impl == "te":
                raise RecipeError(
                    "loss.fusion_impl: te (Transformer Engine's parallel_cross_entropy, a Triton kernel) needs "
                    "CUDA; use native or auto for loss.impl=megatron_fused on CPU"
                )
            if self.model.mtp_num_layers is not None:
                raise RecipeError(
                    f"model.mtp_num_layers: {self.model.mtp_num_layers} (multi-token prediction) needs CUDA "
                    "(megatron-core's MTP loss tracker allocates on the GPU); use null on CPU"
                )
            if self.model.recompute_granularity is not None:
                raise RecipeError(
                    f"model.recompute_granularity: {self.model.recompute_granularity} needs CUDA (megatron-core's "
                    "checkpoint saves and restores the CUDA RNG state); use null on CPU"
                )
        return dp, accumulation

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps if self.optim.decay_steps is not None else self.train.steps


SECTIONS = {f.name: f.type for f in dataclasses.fields(Recipe)}
