"""On GPUs, the Gemma 2 2B recipe at full size (recipes/gemma-2b-owt.yaml: 26 layers, vocabulary
256,000, Gemma 2's sandwich norms, softcaps and sliding window) trains 4 steps at TP 1 and TP 2
through torchrun, exports with ``python -m cce_parallel.export --keep-padding``, and transformers
computes the run's final validation loss from the export.

The run computes in bf16 and the export holds its bf16 weights, so transformers evaluates them in
fp32 (the reference) and in bf16: the run's loss must be within 0.5 % of the fp32 value. The
numbers are printed (run with -s). The data is the offline stdlib text (1,024-token BPE); the model
keeps Gemma's 256,000 rows, the padding that --keep-padding keeps.

    CCE_TEST_GPU=1 python -m pytest -s tests/hf/test_gpu_export.py     # needs 2 GPUs for TP 2
"""

import json
import shutil

import pytest
import torch

from tests.e2e.conftest import ROOT, run_train, train_env
from tests.helpers import gpu_run
from tests.hf.test_train_export import _export, _hf_loss

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied after the test: a case writes about 44 GB (the run's checkpoint of 2.6B
    parameters and its export), which pytest would keep, three runs' worth, on a 64 GiB disk."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_gemma2_2b_export_matches_the_run(scratch, tp):
    tmp_path = scratch
    if not gpu_run() or torch.cuda.device_count() < tp:
        pytest.skip(f"needs CCE_TEST_GPU=1 and {tp} GPUs")
    from cce_parallel.config import Recipe
    from cce_parallel.train.data import prepare
    from cce_parallel.train.metrics import read_metrics

    recipe = Recipe()
    recipe.data.dir, recipe.data.source, recipe.data.tokenizer = str(tmp_path / "data"), "stdlib", "bpe"
    recipe.data.vocab_size, recipe.data.max_documents = 1024, 4000
    prepare(recipe.data)

    env = train_env()
    env.pop("TRITON_INTERPRET")  # compiled kernels
    overrides = [
        f"run.out_dir={tmp_path}", "run.name=gemma", f"data.dir={recipe.data.dir}", "data.source=stdlib",
        "data.tokenizer=bpe", "data.vocab_size=1024", "data.max_documents=4000", f"parallel.tensor={tp}", "train.steps=4", "train.micro_batch_size=1",
        "train.global_batch_size=2", "optim.warmup_steps=1", "eval.interval=0", "eval.iters=1",
        "checkpoint.interval=0", "logging.interval=1", "logging.wandb=disabled",
    ]
    run_train(overrides, nproc=tp, timeout=560, env=env, recipe=str(ROOT / "recipes" / "gemma-2b-owt.yaml"))
    run_dir = tmp_path / "gemma"
    ours = read_metrics(run_dir / "metrics.jsonl")["eval"][4]["val_loss"]

    info = _export(run_dir, tmp_path / "hf", "--keep-padding")
    assert (info["architecture"], info["vocab_size"], info["step"]) == ("gemma2", 256000, 4), info
    fp32 = _hf_loss(tmp_path / "hf", run_dir, "valid", 0, device="cuda", dtype=torch.float32)
    bf16 = _hf_loss(tmp_path / "hf", run_dir, "valid", 0, device="cuda", dtype=torch.bfloat16)
    print(json.dumps({"tp": tp, "run_val_loss": ours, "hf_fp32": fp32, "hf_bf16": bf16,
                      "run_rel_err": abs(ours - fp32) / fp32, "hf_bf16_rel_err": abs(bf16 - fp32) / fp32}))
    assert abs(ours - fp32) < 5e-3 * fp32, (ours, fp32, bf16)
