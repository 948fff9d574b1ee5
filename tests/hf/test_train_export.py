"""Through the train job (torchrun, 2 gloo ranks, RoPE on CPU), as a user would: train a tiny
Llama (TP 2) and a tiny Gemma 2 (FSDP2 over 2 data-parallel ranks), export the checkpoint with ``python -m cce_parallel.export``, and
check that transformers computes the run's own validation loss from the export (fp32, 1e-4
relative); then start a run from the export (``model.init_from``) and check that its first loss
is transformers' loss on that batch. The vocabulary is padded (1,024 BPE tokens to 1,536 rows at
TP 2, 1,152 at TP 1):
the default export cuts the padding, ``--keep-padding`` keeps it (then the losses are exactly ours)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import ROOT, base_overrides, run_train, train_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODELS = {
    "llama": ["model.position_embedding=rope", "model.normalization=RMSNorm", "model.activation=swiglu",
              "model.add_bias_linear=false", "model.num_query_groups=2", "model.tie_embeddings=false",
              "model.rope_scaling_factor=8.0", "model.rotary_base=500000"],
    "gemma2": ["model.position_embedding=rope", "model.normalization=RMSNorm", "model.activation=geglu",
               "model.add_bias_linear=false", "model.num_query_groups=2", "model.kv_channels=32",
               "model.layernorm_epsilon=1e-6", "model.scale_embeddings=true", "model.post_norms=true",
               "model.zero_centered_norm=true", "model.attention_softcap=20.0", "model.sliding_window=24",
               "loss.softcap=30.0", "parallel.tensor=1", "parallel.fsdp=torch"],  # FSDP2 over 2 ranks
}
COMMON = ["model.make_vocab_size_divisible_by=384", "train.steps=3", "optim.warmup_steps=1", "eval.interval=0",
          "eval.iters=1", "checkpoint.interval=0", "logging.interval=1", "data.max_documents=2000"]


def _export(*args):
    done = subprocess.run([sys.executable, "-m", "cce_parallel.export", *map(str, args)], cwd=ROOT, env=train_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _hf_loss(hf_dir, run_dir, which: str, first_sample: int, *, device="cpu", dtype=torch.float32) -> float:
    """transformers' loss on the run's global batch at first_sample (the trainer's: the
    loss_mask-weighted mean), computed on device in dtype."""
    import yaml
    from transformers import AutoModelForCausalLM

    from cce_parallel.config import recipe_from_dict
    from cce_parallel.data.info import load_dataset_info
    from cce_parallel.data.tokenizer import load_tokenizer
    from cce_parallel.train.data import build_batches

    recipe = recipe_from_dict(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    info = load_dataset_info(recipe.data.dir)
    train, valid = build_batches(recipe, info, load_tokenizer(info), dp_rank=0, dp_size=1, device=device)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=dtype).eval().to(device)
    total = count = 0.0
    with torch.no_grad():
        for batch in (valid if which == "valid" else train).microbatches(first_sample):
            logits = model(input_ids=batch["tokens"]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
            total += (loss * batch["loss_mask"].flatten().float()).sum().item()
            count += batch["loss_mask"].sum().item()
    return total / count


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_train_export_and_init_from(tmp_path, data_dir, arch):
    from transformers import AutoTokenizer

    from cce_parallel.data.tokenizer import load_tokenizer
    from cce_parallel.hf.export import export
    from cce_parallel.train.metrics import read_metrics

    run_train(base_overrides(tmp_path, data_dir, arch) + MODELS[arch] + COMMON)
    run_dir = tmp_path / arch
    ours = read_metrics(run_dir / "metrics.jsonl")["eval"][3]["val_loss"]

    rows = 1536 if arch == "llama" else 1152  # 1,024 padded to a multiple of 384 · tp
    # The default export in this process, the padded one through the command line (one process fewer).
    cut = export(run_dir / "checkpoints" / "step_0000003", tmp_path / "hf")
    assert (cut["architecture"], cut["vocab_size"], cut["padded_vocab"], cut["step"]) == (arch, 1024, rows, 3)
    padded = _export(run_dir, tmp_path / "hf_padded", "--keep-padding")  # the run directory: its latest checkpoint
    assert padded["vocab_size"] == rows
    hf_val = _hf_loss(tmp_path / "hf_padded", run_dir, "valid", 0)
    assert abs(hf_val - ours) < 1e-4 * ours, (hf_val, ours)
    # Without the padded rows the other logits are the same, and the softmax loses the padded rows'
    # share: the loss is lower, by at most ln(rows / 1024) (all rows equal).
    cut_val = _hf_loss(tmp_path / "hf", run_dir, "valid", 0)
    assert 0 < ours - cut_val < math.log(rows / 1024) + 1e-3, (cut_val, ours)

    text = "def f(x):\n    return x + 1\n"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer(text)["input_ids"] == load_tokenizer(data_dir).tokenize(text)
    assert tokenizer.eos_token_id == load_tokenizer(data_dir).eod

    if arch == "llama":  # init_from: the first step's loss is transformers' on that batch
        name = f"{arch}_init"
        run_train(base_overrides(tmp_path, data_dir, name) + MODELS[arch] + COMMON
                  + ["train.steps=1", "optim.warmup_steps=0", "optim.schedule=constant", "eval.iters=1",
                     f"model.init_from=hf:{tmp_path / 'hf_padded'}"])
        first = read_metrics(tmp_path / name / "metrics.jsonl")["train"][1]["loss"]
        hf_first = _hf_loss(tmp_path / "hf_padded", tmp_path / name, "train", 0)
        assert abs(first - hf_first) < 1e-4 * hf_first, (first, hf_first)
