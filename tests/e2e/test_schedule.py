"""The learning-rate schedule of a resumed run against its checkpoint's (train.engine.schedule_change),
on megatron-core's OptimizerParamScheduler as the train job builds and restores it; no process group.
The run-level behaviour (the warning, the override that keeps the old schedule) is in test_train.py."""

import math

import pytest
import torch

from cce_parallel.config import load_recipe


def _restored(before: list[str], after: list[str], step: int):
    """(the scheduler state a run of recipe `before` saved at `step`, the scheduler of recipe `after`
    restored from it, recipe `after`), built as build_engine builds them."""
    def scheduler(recipe):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = recipe.optim
        return OptimizerParamScheduler(
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=recipe.decay_steps, lr_decay_style=o.schedule,
            start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=recipe.train.steps, wd_incr_style="constant",
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)

    old = scheduler(load_recipe(None, before))
    old.step(step)
    recipe = load_recipe(None, after)
    new = scheduler(recipe)
    new.load_state_dict(old.state_dict())
    return old.state_dict(), new, recipe


def _cosine(recipe, step: int) -> float:
    o = recipe.optim
    ratio = (step - o.warmup_steps) / (recipe.decay_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1 + math.cos(math.pi * min(ratio, 1.0))) * (o.lr - o.min_lr)


def test_more_steps_stretch_the_decay():
    """Issue 55's run: 30 steps, then train.steps=40. The old schedule is at min_lr past step 30, the
    new one climbs back to its cosine at step 31, and the fix is the old decay length."""
    from cce_parallel.train.engine import schedule_change

    saved, scheduler, recipe = _restored(["train.steps=30"], ["train.steps=40"], 30)
    change = schedule_change(saved, scheduler, recipe)
    assert change is not None and change.first and change.step == 31
    assert change.changed == {"optim.decay_steps": (30, 40)} and change.fix == "--set optim.decay_steps=30"
    assert change.lr_checkpoint == recipe.optim.min_lr
    assert change.lr_recipe == pytest.approx(_cosine(recipe, 31), rel=1e-12) and change.lr_recipe > 2 * recipe.optim.min_lr
    assert scheduler.num_steps == 30  # the restored scheduler is left as it was

    saved, scheduler, kept = _restored(["train.steps=30"], ["train.steps=40", "optim.decay_steps=30"], 30)
    assert schedule_change(saved, scheduler, kept) is None


@pytest.mark.parametrize(("before", "after", "step"), [
    (["optim.schedule=constant"], ["optim.schedule=constant", "optim.min_lr=1e-4"], 10),  # min_lr never reached
    (["train.steps=2", "optim.warmup_steps=1"], ["train.steps=3", "optim.warmup_steps=1"], 2),  # min_lr in both
])
def test_a_change_without_effect_on_the_rates_is_no_change(before, after, step):
    from cce_parallel.train.engine import schedule_change

    saved, scheduler, recipe = _restored(before, after, step)
    assert schedule_change(saved, scheduler, recipe) is None


def test_the_first_step_that_differs_is_named():
    """Stopped in the warmup and resumed with more steps: the warmup's rates are the same, the decay's
    are not; the change names its first step, not the next one."""
    from cce_parallel.train.engine import schedule_change

    saved, scheduler, recipe = _restored(["train.steps=50"], ["train.steps=60"], 2)
    change = schedule_change(saved, scheduler, recipe)
    assert recipe.optim.warmup_steps == 4 and change is not None and not change.first
    assert change.step == 5 and change.lr_recipe == pytest.approx(_cosine(recipe, 5), rel=1e-12)
    assert "Step 5 (the first whose rate differs) trains at" in change.describe()
