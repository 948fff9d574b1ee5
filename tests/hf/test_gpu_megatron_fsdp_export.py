"""On GPUs: checkpoints of Megatron-FSDP (``parallel.fsdp: megatron``: megatron-core's engine,
bf16 with fp32 main weights) export through ``python -m cce_parallel.export``, for the tiny recipe
(GPT-2 style, tied embedding) through torchrun.

- Placement: at a learning rate of 1e-30 no weight moves (an update of at most 1e-30 is below half
  an ulp of every initial weight that is not zero), so the export of a Megatron-FSDP run (its fp32
  main weights, put together from the ranks' uneven shards) must give the export of a DDP run of
  the same seed (its bf16 weights, upcast): DP 2 on 2 GPUs, TP 2 x DP 2 on 4. A shard put in the
  wrong place moves weights of about 0.02 by about as much; the tolerance is 1e-3 (expected: 0).
- Trained: after 8 steps at the recipe's learning rate, transformers computes the run's final
  validation loss from the export in fp32 within 0.5 % of the run's (bf16) value.

The numbers are printed (run with -s):

    CCE_TEST_GPU=1 python -m pytest -s tests/hf/test_gpu_megatron_fsdp_export.py   # 2 GPUs; 4 for TP 2 x DP 2
"""

import importlib.util
import json

import pytest
import torch

from tests.e2e.conftest import base_overrides, run_train, train_env
from tests.helpers import gpu_run
from tests.hf.test_train_export import _export, _hf_loss

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.distributed]

RUN = ["run.device=cuda", "train.precision=bf16", "logging.interval=1", "logging.wandb=disabled", "eval.interval=0",
       "eval.iters=1", "checkpoint.interval=0", "data.max_documents=2000"]
STILL = ["train.steps=2", "optim.warmup_steps=1", "optim.lr=1.0e-30", "optim.min_lr=0.0"]  # no weight moves


def _need(gpus: int):
    if not gpu_run() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs CCE_TEST_GPU=1 and {gpus} CUDA GPUs")
    if importlib.util.find_spec("einops") is None:
        pytest.skip("Megatron-FSDP needs einops (pip install einops)")


def _env() -> dict:
    env = train_env()
    env.pop("TRITON_INTERPRET")  # compiled kernels
    return env


def _weights(hf_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(hf_dir / "model.safetensors"))


def _shard_sizes(run_dir) -> dict:
    """{parameter (tp rank, name): [elements on each data-parallel rank]} from the shard indexes."""
    path = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    sizes: dict = {}
    for file in sorted(path.glob("rank*.shards.json")):
        index = json.loads(file.read_text())
        assert "error" not in index, (file.name, index["error"])
        for entry in index["params"]:
            sizes.setdefault((index["tp"], entry["name"]), {})[index["dp"]] = entry["stop"] - entry["start"]
    return {k: [v[d] for d in sorted(v)] for k, v in sizes.items()}


@pytest.mark.parametrize("gpus", [2, 4], ids=["dp2", "tp2_dp2"])
def test_megatron_fsdp_export_equals_ddp_export(tmp_path, data_dir, gpus):
    _need(gpus)
    layout = [f"parallel.tensor={gpus // 2}"]
    exports = {}
    for fsdp in ("none", "megatron"):
        name = f"still-{fsdp}"
        run_train(base_overrides(tmp_path, data_dir, name) + RUN + layout + STILL + [f"parallel.fsdp={fsdp}"],
                  nproc=gpus, env=_env(), timeout=300)
        summary = _export(tmp_path / name, tmp_path / f"hf-{fsdp}", "--no-tokenizer")
        assert (summary["architecture"], summary["step"], summary["vocab_size"]) == ("gpt2", 2, 1024), summary
        exports[fsdp] = _weights(tmp_path / f"hf-{fsdp}")

    sizes = _shard_sizes(tmp_path / "still-megatron")
    split = [k for k, v in sizes.items() if all(n > 0 for n in v)]
    empty = [k for k, v in sizes.items() if 0 in v]
    assert split, sizes  # some parameter's elements are on both data-parallel ranks: reassembly was needed

    ddp, fsdp = exports["none"], exports["megatron"]
    assert sorted(fsdp) == sorted(ddp)
    diffs = {k: (fsdp[k] - ddp[k]).abs().max().item() for k in ddp}
    worst = max(diffs, key=diffs.get)
    print(json.dumps({"gpus": gpus, "tensors": len(ddp), "params_split_over_dp": len(split),
                      "params_empty_on_a_rank": len(empty), "bitwise": all(torch.equal(fsdp[k], ddp[k]) for k in ddp),
                      "max_abs_diff": diffs[worst], "at": worst}))
    assert ddp["transformer.wte.weight"].std() > 1e-3  # random weights: a misplaced shard would show
    assert diffs[worst] <= 1e-3, (worst, diffs[worst])


def test_megatron_fsdp_export_gives_the_runs_loss(tmp_path, data_dir):
    from cce_parallel.train.metrics import read_metrics

    _need(2)
    run_dir = tmp_path / "trained"
    steps = 8
    run_train(base_overrides(tmp_path, data_dir, "trained") + RUN
              + ["parallel.tensor=1", "parallel.fsdp=megatron", f"train.steps={steps}", "optim.warmup_steps=1"],
              nproc=2, env=_env(), timeout=300)
    ours = read_metrics(run_dir / "metrics.jsonl")["eval"][steps]["val_loss"]
    summary = _export(run_dir, tmp_path / "hf")
    assert (summary["step"], summary["vocab_size"]) == (steps, 1024), summary
    fp32 = _hf_loss(tmp_path / "hf", run_dir, "valid", 0, device="cuda", dtype=torch.float32)
    bf16 = _hf_loss(tmp_path / "hf", run_dir, "valid", 0, device="cuda", dtype=torch.bfloat16)
    print(json.dumps({"run_val_loss": ours, "hf_fp32": fp32, "hf_bf16": bf16, "run_rel_err": abs(ours - fp32) / fp32}))
    assert abs(ours - fp32) < 5e-3 * fp32, (ours, fp32, bf16)
