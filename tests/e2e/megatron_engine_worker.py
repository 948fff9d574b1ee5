"""Worker (two ranks, forked by test_megatron_engine.py as torchrun starts them: tests/dist.py):
the CUDA engine on CPU tensors.

The trainer's CUDA path (engine._megatron: Float16Module, megatron-core's DDP, get_megatron_optimizer,
get_forward_backward_func; checkpoint save/load of its optimizers) allocates on CUDA, so it cannot
run on a CPU machine as is. Here a TorchFunctionMode redirects ``device="cuda"`` allocations to the
CPU, and a few CUDA-only calls and type checks are stubbed, so the same code runs over gloo:
five optimizer steps, a checkpoint after three (lean with checkpoint.lean=true), and the last
two steps again from the checkpoint in a freshly built engine. Prints one JSON line per scenario:
the losses and gradient norms of both.

    python -m torch.distributed.run --nproc-per-node 2 tests/e2e/megatron_engine_worker.py \\
        {megatron|cpu} CKPT_DIR DTYPE section.key=value ... [-- {megatron|cpu} CKPT_DIR DTYPE ...]

Several scenarios (separated by ``--``) run one after another in one launch, each in its own
model-parallel layout and from the recipe's seed, as they would in launches of their own: a
launch costs its processes several seconds of imports each.
"""

import contextlib
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.overrides import TorchFunctionMode


class CudaOnCpu(TorchFunctionMode):
    """device="cuda" (or an index) becomes the CPU; tensor.type() answers as for a CUDA tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if getattr(func, "__name__", "") == "type" and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and (str(device).startswith("cuda") or isinstance(device, int)):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _NoRNGTracker:
    def is_initialized(self):
        return True

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


class _NoStream:
    """A CUDA stream on CPU, where work runs in issue order: nothing to wait for."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


def install_shims():
    import megatron.core.optimizer.optimizer as megatron_optimizer
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda device=None: _NoStream()  # DDP's grad sync waits on it (>= 0.17)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    megatron_random._CUDA_RNG_STATE_TRACKER = _NoRNGTracker()

    def clip(parameters, max_norm, total_norm, use_decoupled_grad=False):  # without its CUDA type assert
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(coeff)

    megatron_optimizer.clip_grad_by_total_norm_fp32 = clip


def scenarios(argv: list) -> list:
    """argv split at each "--": [[kind, ckpt_dir, dtype, overrides...], ...]."""
    groups = [[]]
    for arg in argv:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    return groups


def main():
    for index, (kind, ckpt_dir, dtype_name, *overrides) in enumerate(scenarios(sys.argv[1:])):
        run(index, kind, ckpt_dir, dtype_name, overrides)
    from cce_parallel.train import launch

    launch.shutdown()


def run(index, kind, ckpt_dir, dtype_name, overrides):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    import torch.distributed as dist

    from cce_parallel.config import Recipe, load_recipe
    from cce_parallel.train import launch

    recipe = load_recipe(None, overrides)
    recipe.check_world = lambda world, device: Recipe.check_world(recipe, world, "cuda")  # CUDA features allowed
    launch.quiet_warnings()
    launch.prepare_environment(recipe, "cpu")
    layout = launch.init_distributed(recipe, "cpu")
    install_shims()

    from megatron.core import parallel_state

    from cce_parallel.data.tokenizer import load_tokenizer
    from cce_parallel.train import checkpoint
    from cce_parallel.train.data import build_batches, prepare_on_rank0
    from cce_parallel.train.engine import build_engine
    from cce_parallel.train.gpt import build_gpt, model_vocab_size, transformer_config
    from cce_parallel.train.trainer import forward_step

    info = prepare_on_rank0(recipe.data)
    batches, _ = build_batches(recipe, info, load_tokenizer(info), dp_rank=layout["dp_rank"], dp_size=layout["dp"],
                               device=torch.device("cpu"))

    def make_engine():
        config = transformer_config(recipe, dtype=dtype, cpu_init=True)
        model = build_gpt(recipe, config, vocab_size=model_vocab_size(recipe, info.vocab_size), device="cpu")
        return build_engine(recipe, model, config, device="cuda" if kind == "megatron" else "cpu", dtype=dtype)

    def step(engine, k):
        engine.scheduler.step(1)
        engine.zero_grad()
        reports = engine.forward_backward(
            forward_step_func=forward_step, data_iterator=batches.microbatches(k * recipe.train.global_batch_size),
            model=engine.model, num_microbatches=layout["accumulation"], seq_length=recipe.model.seq_length,
            micro_batch_size=recipe.train.micro_batch_size, decoder_seq_length=recipe.model.seq_length,
        )
        _, grad_norm, _ = engine.optimizer.step()
        total = torch.zeros(2, dtype=torch.float64)
        for report in reports:
            total += report["lm loss"].double()
        if parallel_state.is_pipeline_last_stage():
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return [total[0].item() / total[1].item(), float(grad_norm)]

    with CudaOnCpu():
        engine = make_engine()
        losses = []
        for k in range(5):
            if k == 3:
                checkpoint.save(ckpt_dir, step=3, consumed_samples=0, engine=engine, meta={"layout": layout},
                                lean=recipe.checkpoint.lean)
            losses.append(step(engine, k))
        torch.manual_seed(12345)  # the fresh engine starts from other weights
        resumed_engine = make_engine()
        checkpoint.load(checkpoint.latest_checkpoint(ckpt_dir), engine=resumed_engine, layout=layout)
        resumed = [step(resumed_engine, k) for k in (3, 4)]
    if dist.get_rank() == 0:
        saved = checkpoint.latest_checkpoint(ckpt_dir)
        doc = saved / "tp0_pp0.weights.json"  # a lean checkpoint's: the weights left out, by chunk
        left_out = sum(map(len, json.loads(doc.read_text())["chunks"])) if doc.exists() else 0
        weights = sum(isinstance(v, torch.nn.Parameter)
                      for chunk in engine.model for v in chunk.module.state_dict(keep_vars=True).values())
        names = {
            "optimizers": [type(m).__name__ for m in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])],
            "model": type(engine.model[0]).__name__,
            "model_weights": checkpoint.read_meta(saved)["model_weights"],
            "weights": weights, "left_out": left_out,  # rank 0's model weights; those a lean save left out
        }
        print(f"RESULT {index} " + json.dumps({"losses": losses, "resumed": resumed, **names}), flush=True)


if __name__ == "__main__":
    main()
