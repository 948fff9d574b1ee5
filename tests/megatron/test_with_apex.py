"""The job's model where apex is installed (NGC containers), checked on CPU with a stand-in.

megatron-core decides at import, by ``import apex``, to build its norms as apex's FusedLayerNorm,
which refuses RMSNorm and needs apex's CUDA extension. A package named ``apex`` with nothing in
it makes megatron-core take that branch here, and any FusedLayerNorm left in the model fails to
build. On an H200 with the real apex, llama-1b-owt.yaml died that way before the final norm came
from our spec (benchmarks/results/h200_20261129_apex).
"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import child_pythonpath

ROOT = Path(__file__).resolve().parents[2]

BUILD = textwrap.dedent("""
    import sys
    import torch
    import megatron.core.models.gpt.gpt_layer_specs as specs
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    assert specs.HAVE_APEX, "the stand-in apex was not seen"
    from cce_parallel.config import load_recipe
    from cce_parallel.train.gpt import build_gpt, model_vocab_size, transformer_config
    from tests.dist import one_megatron_rank

    for norm in ("RMSNorm", "LayerNorm"):
        recipe = load_recipe(None, ["parallel.tensor=1", f"model.normalization={norm}", "model.hidden_size=32"])
        with one_megatron_rank():
            config = transformer_config(recipe, dtype=torch.float32, cpu_init=True)
            model = build_gpt(recipe, config, vocab_size=model_vocab_size(recipe, 256), device="cpu")
        kinds = {type(m).__name__ for m in model.modules()}
        assert not any(isinstance(m, FusedLayerNorm) for m in model.modules()), kinds
        assert type(model.decoder.final_layernorm).__name__ == norm, type(model.decoder.final_layernorm)
        print(norm, "built")
""")


def test_the_job_builds_no_apex_norm_where_apex_is_installed(tmp_path):
    pytest.importorskip("megatron.core")
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    env = {"PYTHONPATH": child_pythonpath(tmp_path, ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", BUILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["RMSNorm built", "LayerNorm built"], done.stdout
