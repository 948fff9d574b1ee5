"""Peak memory per rank of one megatron-core GPTModel training step: Megatron's output path next to CCE.

The question: how much memory does ``use_cce`` save in a real Megatron step at a large vocabulary?
Defaults: V = 256,000 (Gemma 2), hidden 2304, 2 layers, TP = 2 with sequence parallelism, bf16
(Float16Module), Megatron DDP with fp32 grad buffers, 8,192 tokens per step (seq 4096 × micro-batch 2).

Paths, each a fresh GPTModel built from ``cce_parallel.megatron.local_gpt_block_spec`` (no TE, no apex):
- ``megatron``: GPTModel as megatron-core builds it: ``ColumnParallelLinear`` logits [s, b, V/tp] in
  bf16, then ``vocab_parallel_cross_entropy`` (fp32 inside);
- ``cce:<impl>``: the same model after ``use_cce(model, impl=<impl>)``: no logits.

One step = forward with labels, Megatron-LM's masked mean over tokens, backward, and
``finalize_model_grads`` (DDP). Per rank and path, after one warm-up step, over --repeats steps:
- step peak: ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` just before the step
  (activations, logits, loss intermediates, transient gradients: what the step adds);
- absolute peak: ``max_memory_allocated`` itself (parameters, DDP buffers and the step);
- baseline: ``memory_allocated`` before the step; step time: median, CUDA events.

Launch (2 GPUs):
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_megatron_memory.py --out benchmarks/results
    benchmarks/run_bench_megatron_memory.sh benchmarks/results [options]
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_megatron_memory.py --cpu-smoke --out /tmp/m
      (gloo, tiny, impl torch: tests the plumbing; no memory figures on CPU)

Results: <out>/<gpu>_<yyyymmdd>_megatron_memory[_<tag>].{json,md}, written by rank 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import _common as C
import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vocab", type=int, default=256000, help="the model's (padded) vocabulary")
    p.add_argument("--hidden", type=int, default=2304)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 × hidden)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2, help="micro-batch size")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (the world is tp × dp)")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="turn sequence parallelism off")
    p.add_argument("--tied", action="store_true", help="tie the embedding and output weights")
    p.add_argument("--no-ddp", dest="ddp", action="store_false", help="plain autograd grads, no Megatron DDP")
    p.add_argument(
        "--cce-fusion",
        action="store_true",
        help="CCE accumulates ∇W into DDP's main_grad (Megatron needs apex for the same)",
    )
    p.add_argument("--impls", default="cce_kahan_full_c", help="comma list of CCE impls")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tag", default=None, help="suffix of the result files")
    p.add_argument("--commit", default=None, help="git commit to record (default: git rev-parse HEAD)")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, tiny shapes, impl torch")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.vocab, args.hidden, args.heads, args.layers, args.seq, args.mbs = 1024, 64, 4, 1, 32, 2
        args.impls, args.repeats, args.sp, args.ddp = "torch", 1, False, False
    args.ffn = args.ffn or 4 * args.hidden
    return args


# ---------------------------------------------------------------------------------------------


def init(args):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", rank))
    if "MASTER_ADDR" not in os.environ:  # plain `python`: a world of one
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"})
    timeout = _dt.timedelta(seconds=600)
    if args.cpu_smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run on GPUs, or use --cpu-smoke to test the plumbing")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout, device_id=device)
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return rank, world, device


def build(args, device, impl):
    """A GPTModel (Float16Module, DDP as asked); with impl, switched to CCE."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cce_parallel.megatron import local_gpt_block_spec, use_cce

    bf16 = not args.cpu_smoke
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=args.tp,
        sequence_parallel=args.sp and args.tp > 1,
        use_cpu_initialization=device.type != "cuda",
        params_dtype=dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    torch.manual_seed(1)
    gpt = GPTModel(
        config,
        local_gpt_block_spec(config),
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        share_embeddings_and_output_weights=args.tied,
    )
    if impl is not None:
        use_cce(gpt, impl=impl)
    model = gpt.to(device)
    if bf16:
        model = Float16Module(config, model)
    if args.ddp:
        model = DistributedDataParallel(
            config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
        )
        if impl is not None and args.cce_fusion:
            gpt.output_layer.gradient_accumulation_fusion = True
    return model, gpt


def batch(args, device):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab, (args.mbs, args.seq + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "position_ids": torch.arange(args.seq).expand(args.mbs, -1).to(device),
        "loss_mask": torch.ones(args.mbs, args.seq, device=device),
    }


def step(args, model, gpt, b):
    from megatron.core.distributed import finalize_model_grads

    if args.ddp:
        model.zero_grad_buffer()
    for p in gpt.parameters():
        p.grad = None
    losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [b, s] fp32
    mask = b["loss_mask"]
    loss = (losses.float() * mask).sum() / mask.sum()
    loss.backward()
    if args.ddp:
        finalize_model_grads([model])
    return loss.detach()


def measure(args, device, impl) -> dict:
    model, gpt = build(args, device, impl)
    b = batch(args, device)
    step(args, model, gpt, b)  # warm-up: Triton kernels compiled, DDP buffers used once
    cuda = device.type == "cuda"
    peaks, absolute, times, base = [], [], [], None
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = step(args, model, gpt, b)
        if cuda:
            stop.record()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - base)
            absolute.append(torch.cuda.max_memory_allocated(device))
            times.append(start.elapsed_time(stop))
        else:
            times.append(1e3 * (time.perf_counter() - t0))
    out = {
        "loss": float(loss),
        "step_peak_bytes": max(peaks) if peaks else None,
        "absolute_peak_bytes": max(absolute) if absolute else None,
        "baseline_bytes": base,
        "step_ms": statistics.median(times),
    }
    del model, gpt, b
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------


def render_markdown(data: dict) -> str:
    a, meta = data["config"], data["meta"]
    world, tp = data["world"], a["tp"]
    tokens = a["seq"] * a["mbs"]
    logits = tokens * a["vocab"] // tp * 2
    setup = (
        f"V = {a['vocab']:,}, hidden {a['hidden']}, {a['layers']} layers, TP = {tp} "
        f"({'with' if a['sp'] else 'without'} sequence parallelism), {world // tp} DP, "
        f"{tokens:,} tokens per micro-batch (seq {a['seq']} × {a['mbs']}), "
        f"{'bf16' if not a['cpu_smoke'] else 'fp32'}, "
        f"{'Megatron DDP (fp32 grads)' if a['ddp'] else 'no DDP'}, "
        f"{'tied' if a['tied'] else 'untied'} embeddings. "
        f"Megatron's bf16 logits alone are {C.fmt_mib(logits)} MiB per rank."
    )
    lines = [
        f"# Peak memory of one GPTModel step: Megatron's output path vs CCE ({meta['device']})",
        "",
        setup,
        "",
        (
            "MiB (2^20 B) per rank, max over ranks; step peak = max_memory_allocated above memory_allocated "
            "just before the step; absolute = max_memory_allocated."
        ),
        "",
        "| path | step peak | absolute peak | baseline (params, buffers) | step ms | loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for path, per_rank in data["results"].items():

        def worst(key, rows=per_rank):
            vals = [r[key] for r in rows if r.get(key) is not None]
            return max(vals) if vals else None

        lines.append(
            f"| {path} | {C.fmt_mib(worst('step_peak_bytes'))} | "
            f"{C.fmt_mib(worst('absolute_peak_bytes'))} | {C.fmt_mib(worst('baseline_bytes'))} | "
            f"{C.fmt_num(worst('step_ms'))} | {per_rank[0]['loss']:.4f} |"
        )
    meg = data["results"].get("megatron")
    for path, per_rank in data["results"].items():
        if path == "megatron" or meg is None:
            continue
        m = max((r["step_peak_bytes"] or 0) for r in meg)
        c = max((r["step_peak_bytes"] or 0) for r in per_rank)
        if m and c:
            lines += [
                "",
                f"{path}: step peak {c / m:.2f}× Megatron's ({C.fmt_mib(m - c)} MiB less per rank).",
            ]
    lines += [
        "",
        (
            f"GPU: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
            f"commit {meta['git_commit']}; {meta['date']}."
        ),
        "",
        f"Command: `{meta['command']}`",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    rank, world, device = init(args)
    results = {}
    paths = [("megatron", None)] + [(f"cce:{impl}", impl) for impl in C.csv_list(args.impls)]
    for name, impl in paths:
        mine = measure(args, device, impl)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
        if rank == 0:
            peaks = [r["step_peak_bytes"] for r in gathered if r["step_peak_bytes"] is not None]
            peak = C.fmt_mib(max(peaks) if peaks else None)
            print(
                f"{name:24s} step peak {peak} MiB  loss {mine['loss']:.4f}  {mine['step_ms']:.1f} ms",
                flush=True,
            )
    if rank == 0:
        meta = C.run_metadata(device, args.commit)
        data = {"meta": meta, "config": vars(args), "world": world, "results": results}
        stem = C.out_stem(Path(args.out), meta, "megatron_memory" + (f"_{args.tag}" if args.tag else ""))
        C.write_json(stem.with_suffix(".json"), data)
        stem.with_suffix(".md").write_text(render_markdown(data))
        print(f"wrote {stem}.json and .md")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
