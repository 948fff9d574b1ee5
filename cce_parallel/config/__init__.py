"""Recipes: documented dataclasses (schema.py: ``Recipe``; its sections in model.py and training.py)
loaded strictly from YAML (loader.py).

    from cce_parallel.config import load_recipe
    recipe = load_recipe("recipes/tiny.yaml", ["train.steps=100"])

``Recipe()`` is the tiny recipe (the default of ``python -m cce_parallel.train``). No torch import.
"""

from cce_parallel.config.loader import (
    apply_override,
    diff_from_defaults,
    dump_recipe,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
)
from cce_parallel.config.model import (
    CCE_IMPLS,
    LOSS_IMPLS,
    MEGATRON_IMPLS,
    LossConfig,
    ModelConfig,
    ParallelConfig,
)
from cce_parallel.config.schema import Recipe
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

__all__ = [
    "CCE_IMPLS",
    "LOSS_IMPLS",
    "MEGATRON_IMPLS",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Recipe",
    "RecipeError",
    "RunConfig",
    "TrainConfig",
    "apply_override",
    "diff_from_defaults",
    "dump_recipe",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
]
