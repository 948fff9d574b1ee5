"""The trainer's CUDA engine (megatron-core DDP, optimizers, schedules) on CPU tensors.

GPUs run engine._megatron; CPU runs its stand-ins (cpu.py). megatron_engine_worker.py redirects
CUDA allocations to the CPU so that the CUDA path runs here over gloo; these tests check that it
trains like the stand-ins and that its checkpoints resume bitwise, for TP=2, the distributed
optimizer in bf16 with megatron's loss (a lean save asked for is saved whole), and a 2-stage
pipeline with a tied embedding (a lean checkpoint). Lean bf16 checkpoints of megatron's mixed-
precision optimizer, under DDP and FSDP2: tests/e2e/test_fsdp.py.
"""

import json

import pytest

from tests.dist import run_entry_point
from tests.e2e.conftest import ROOT, train_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.interpreter]


def run_engines(tmp_path, tiny_data, scenarios: dict) -> dict:
    """The scenarios {name: (kind, dtype, overrides...)}, one after another in one two-rank
    launch of megatron_engine_worker.py (its ranks forked as torchrun starts them: tests/dist.py):
    {name: its result}."""
    argv = []
    for name, (kind, dtype, *overrides) in scenarios.items():
        argv += [*(["--"] if argv else []), kind, str(tmp_path / f"ckpt_{name}"), dtype, f"data.dir={tiny_data}", *overrides]
    done = run_entry_point(argv, 2, env=train_env(), cwd=ROOT, timeout=150 * len(scenarios),
                           main="tests.e2e.megatron_engine_worker:main")
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            index, payload = line[len("RESULT "):].split(" ", 1)
            results[list(scenarios)[int(index)]] = json.loads(payload)
    if done.returncode != 0 or len(results) != len(scenarios):
        pytest.fail(f"worker failed (exit {done.returncode}):\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}")
    return results


@pytest.fixture(scope="module")
def engines(tmp_path_factory, tiny_data):
    return run_engines(tmp_path_factory.mktemp("engines"), tiny_data, {
        "tp2": ("megatron", "fp32", "parallel.tensor=2"),
        "tp2_cpu": ("cpu", "fp32", "parallel.tensor=2"),
        "distopt_bf16": ("megatron", "bf16", "parallel.tensor=1", "parallel.distributed_optimizer=true",
                         "train.global_batch_size=16", "loss.impl=megatron", "checkpoint.lean=true"),
        "pp2": ("megatron", "fp32", "parallel.tensor=1", "parallel.pipeline=2", "checkpoint.lean=true"),
        "tp2_again": ("megatron", "fp32", "parallel.tensor=2"),
    })


def test_tp2_matches_the_cpu_engine_and_resumes(engines):
    megatron, cpu = engines["tp2"], engines["tp2_cpu"]
    assert megatron["model"] == "DistributedDataParallel" and cpu["model"] == "LocalDDP"
    assert [x[0] for x in megatron["losses"]] == pytest.approx([x[0] for x in cpu["losses"]], rel=1e-6)
    assert [x[1] for x in megatron["losses"]] == pytest.approx([x[1] for x in cpu["losses"]], rel=1e-5)
    for result in (megatron, cpu):
        assert result["resumed"] == result["losses"][3:]


def test_distributed_optimizer_bf16_megatron_loss_resumes(engines):
    result = engines["distopt_bf16"]
    assert result["model_weights"] == "model" and result["left_out"] == 0  # main-weight shards only: saved whole
    assert result["optimizers"] == ["DistributedOptimizer"]
    assert result["losses"][4][0] < result["losses"][0][0] - 0.3
    assert result["resumed"] == result["losses"][3:]


def test_pipeline_two_stages_resumes(engines):
    result = engines["pp2"]
    assert result["model_weights"] == "main_params"  # meta.json: stage 0 lean (both resume bitwise)
    assert result["left_out"] == result["weights"] > 0
    assert result["losses"][4][0] < result["losses"][0][0] - 0.3
    assert result["resumed"] == result["losses"][3:]


def test_a_scenario_gives_the_same_after_others_in_its_launch(engines):
    """The launch's first scenario, run again after the others: nothing carries over between them."""
    assert engines["tp2_again"] == engines["tp2"]
