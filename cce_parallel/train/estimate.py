"""--dry-run: check a recipe, build its model on the meta device, print sizes, memory and layout.

No GPU and no torchrun needed: a single process joins torch's "fake" process group
(collectives are no-ops) as the first rank of each pipeline stage in turn, and builds that
rank's GPTModel stage on the meta device, so the parameter counts are the real model's, shard
by shard. The checks and the estimate are for CUDA (bf16 unless train.precision says otherwise)
unless run.device is cpu or --device cpu is given.

The memory estimate per rank, in bytes (b: micro-batch, s: sequence, h: hidden, V: padded
vocabulary, tp/dp: parallel sizes, P: this rank's parameters):
- weights P · (2 in bf16, 4 in fp32); gradients P · 4 (Megatron reduces them in fp32);
- Adam: P · 12 with bf16 (fp32 main weights + two moments), P · 8 with fp32, / dp with the
  distributed optimizer;
- with parallel.fsdp: weights, gradients and Adam state / dp, plus the weights FSDP gathers, in
  the compute dtype: the root unit (final norm, output layer, and a tied embedding, held from the
  forward to the backward; under Megatron-FSDP an untied embedding too) and two layers (one
  computing, one prefetched). The gradients: under FSDP2 shards in the compute dtype plus, with
  bf16, the optimizer's fp32 copies, P · (2 + 4) / dp; under Megatron-FSDP fp32 shards, P · 4 / dp,
  plus fp32 buckets for the gathered units' gradients;
- activations per layer and micro-batch, Korthikanti et al. (2022) with flash-style attention
  (no s² term): s·b·h·(10 + 24/tp) · 2 bytes, or s·b·h·34/tp with sequence parallelism; times the
  stage's layers and the micro-batches in flight (pp on the first stage under 1F1B). Approximate.
  With model.recompute_granularity (``activation_bytes``):
  - full: a recomputed layer keeps only its input, s·b·h · 2 bytes (/tp with sequence
    parallelism); uniform keeps the input of each chunk of recompute_num_layers layers, block
    recomputes recompute_num_layers layers of each stage and keeps the others whole; plus, once,
    the activations of the unit being recomputed in the backward (a chunk, or one layer);
  - selective core_attn: drops nothing here, since flash-style attention keeps no s² scores (its
    inputs Q, K, V stay saved); it pays off only with an attention that materializes them.
- the loss layer of the last stage, per micro-batch of N = s·b tokens:
  megatron: the logits [N, V/tp] in fp32 and their gradient, 8·N·V/tp;
  CCE, one-pass (the default): fp32 ∇E [N, h] and ∇C [V/tp, h], plus the larger of the logits
  buffer (loss.logits_budget, equal token blocks of N·V/tp logits at most, in the compute dtype;
  fp32 for fp16 and for softcap with label smoothing; ∇C's temporaries live in ∇E's rows) and the
  gradients in the compute dtype that the backward returns; in bf16 without label smoothing, when
  no fp32 main_grad takes ∇C, ∇C is bf16, and over several blocks an fp32 row per distinct
  target (at most min(N, V/tp)) is added;
  CCE, lean: ∇E + ∇C in the compute dtype plus a workspace of at most 64 MiB.

The checkpoint: its bytes (grace.checkpoint_bytes: the weights, fp32 main weights and two Adam
moments per parameter, each parameter once) and the save's time at the write speed that earlier
saves in the run directory measured, else an assumed 1 GB/s; on a signal, the grace the
launcher must give (grace.py).
"""

import contextlib
import math
from pathlib import Path

import torch
import torch.distributed as dist

from cce_parallel.config import Recipe, RecipeError
from cce_parallel.train import grace


def _tokenizer_vocab(recipe: Recipe) -> int:
    if recipe.data.tokenizer == "bpe":
        return recipe.data.vocab_size
    try:
        from cce_parallel.data import load_dataset_info

        return load_dataset_info(recipe.data.resolved_dir()).vocab_size
    except (FileNotFoundError, OSError, ValueError):
        if recipe.model.vocab_size is None:
            raise RecipeError(
                f"model.vocab_size: needed for a dry run with data.tokenizer={recipe.data.tokenizer} "
                f"(the dataset in {recipe.data.resolved_dir()} is not prepared yet)"
            ) from None
        return recipe.model.vocab_size


@contextlib.contextmanager
def _meta_cuda():
    """GPTModel moves a tied embedding to .cuda() to sync it across pipeline stages: a meta
    tensor stays a meta tensor (there may be no CUDA at all)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self if self.is_meta else original(self, *a, **k)
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _build_stage(recipe: Recipe, *, rank: int, world: int, device: str, dtype, vocab: int):
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from cce_parallel.train.gpt import build_gpt, count_parameters, transformer_config

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        p = recipe.parallel
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
            create_gloo_process_groups=False,
        )
        config = transformer_config(recipe, dtype=dtype, cpu_init=True)
        with torch.device("meta"), _meta_cuda():
            model = build_gpt(recipe, config, vocab_size=vocab, device=device)
        local, stage = count_parameters(model, p.tensor)
        embedding = sum(
            prm.numel() for name, prm in model.named_parameters() if "word_embeddings" in name or "output_layer" in name
        )
        # FSDP units: each layer; for FSDP2 (engine.torch_fsdp) also the embedding unless tied;
        # the root (the rest).
        layers = model.decoder.layers
        layer_params = max((sum(prm.numel() for prm in layer.parameters()) for layer in layers), default=0)
        root = local - sum(prm.numel() for layer in layers for prm in layer.parameters())
        if model.pre_process and not recipe.model.tie_embeddings and p.fsdp == "torch":
            root -= sum(prm.numel() for prm in model.embedding.parameters())
        return {"rank": rank, "params_local": local, "params_stage": stage, "embedding_local": embedding,
                "fsdp_gathered": root + 2 * layer_params if p.fsdp != "none" else 0,
                "layers": len(model.decoder.layers), "type": type(model).__name__,
                "output_layer": type(model.output_layer).__name__ if model.post_process else None}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def dry_run(recipe: Recipe, *, world_size: int | None = None, device: str | None = None, quiet: bool = False) -> dict:
    """Check the recipe for a world size, build each stage on meta, and report; returns the report."""
    from cce_parallel.train.launch import needed_world_size
    from cce_parallel.train.gpt import flops_per_token, grad_accumulation_fusion, model_vocab_size

    p, m, t = recipe.parallel, recipe.model, recipe.train
    world = world_size or needed_world_size(recipe)
    # The GPUs a recipe is written for, unless it names the CPU (--device cpu checks a CPU run).
    device = device or ("cpu" if recipe.run.device == "cpu" else "cuda")
    dp, accumulation = recipe.check_world(world, device)
    if recipe.loss.kernel_config:
        from cce_parallel.train.launch import check_kernel_config

        check_kernel_config(recipe.loss.kernel_config)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(t.precision, torch.bfloat16 if device == "cuda" else torch.float32)
    tokenizer_vocab = _tokenizer_vocab(recipe)
    vocab = model_vocab_size(recipe, tokenizer_vocab)

    stages = [
        _build_stage(recipe, rank=s * p.tensor * dp, world=world, device=device, dtype=dtype, vocab=vocab)
        for s in range(p.pipeline)
    ]
    total = sum(s["params_stage"] for s in stages)
    if p.pipeline > 1 and m.tie_embeddings:
        total -= vocab * m.hidden_size  # the last stage's copy of the tied embedding

    width = 2 if dtype == torch.bfloat16 else 4
    # The output layer adds ∇C into an fp32 main_grad where the job turns gradient-accumulation
    # fusion on (apex's extension installed here, as on the machine that will train).
    main_grad = grad_accumulation_fusion(recipe, cpu_init=device != "cuda")
    b, s, h = t.micro_batch_size, m.seq_length, m.hidden_size
    n_tokens = b * s
    memory = []
    for index, stage in enumerate(stages):
        P = stage["params_local"]
        weights, grads = P * width, P * 4
        optimizer = P * (12 if width == 2 else 8) / (dp if p.distributed_optimizer else 1)
        if p.fsdp != "none":
            weights = P * width / dp + stage["fsdp_gathered"] * width
            grads = P * (width + (4 if width == 2 else 0)) / dp
            if p.fsdp == "megatron":  # fp32 shards, and fp32 buckets of the gathered units' gradients
                grads = (P / dp + stage["fsdp_gathered"]) * 4
            optimizer = P * (12 if width == 2 else 8) / dp
        in_flight = min(p.pipeline - index, accumulation) if p.pipeline > 1 else 1
        activations = activation_bytes(recipe, layers=stage["layers"], in_flight=in_flight, width=width)
        base = weights + grads + optimizer + activations
        last = index == p.pipeline - 1
        logits = 8 * n_tokens * vocab / p.tensor if last else 0
        cce = cce_loss_bytes(recipe, n_tokens, vocab / p.tensor, h, dtype, main_grad=main_grad) if last else 0
        memory.append({"stage": index, "weights": weights, "grads": grads, "optimizer": optimizer,
                       "activations": activations, "loss_megatron": logits, "loss_cce": cce,
                       "total_megatron": base + logits, "total_cce": base + cce})

    # Every tensor-parallel rank of a stage holds about its first rank's parameters.
    stored = sum(stage["params_local"] for stage in stages) * p.tensor
    save = grace.estimate(grace.checkpoint_bytes(stored, width, p.fsdp), run_dir=Path(recipe.run.out_dir) / recipe.run.name,
                          asynchronous=recipe.checkpoint.asynchronous)
    report = {
        "recipe": recipe.run.name, "world": world, "tp": p.tensor, "pp": p.pipeline, "dp": dp,
        "accumulation": accumulation, "device": device, "dtype": str(dtype).replace("torch.", ""),
        "vocab": vocab, "tokenizer_vocab": tokenizer_vocab, "params_total": total, "stages": stages,
        "memory": memory, "flops_per_token": flops_per_token(recipe, vocab), "loss_impl": recipe.loss.impl,
        "tokens_per_step": t.global_batch_size * s, "save": save.to_json(), "save_s": save.save_s,
    }
    if not quiet:
        print(format_report(recipe, report))
    return report


def cce_loss_bytes(recipe: Recipe, n_tokens: int, shard: float, h: int, dtype, *, main_grad: bool = False) -> float:
    """Peak bytes of the CCE loss layer for n_tokens tokens over a vocabulary shard of `shard` rows
    (see the module docstring); main_grad: ∇C goes into an fp32 main_grad (so it stays fp32)."""
    from cce_parallel.ops.common import fused_one_pass, token_block
    from cce_parallel.ops.functional import resolve_logits_budget

    width = torch.empty((), dtype=dtype).element_size()
    outputs = (n_tokens * h + shard * h) * width
    loss = recipe.loss
    fused = fused_one_pass(dtype, loss.softcap, loss.label_smoothing)
    logit_width = width if fused else 4
    rows = math.ceil(shard)
    # dC in the input dtype on the fused path without label smoothing (ops/one_pass.py)
    low = fused and loss.label_smoothing == 0 and not main_grad and width < 4
    budget = resolve_logits_budget(loss.logits_budget, n_tokens * rows * logit_width, bf16_dc=low)
    if budget == 0:
        return outputs + (64 << 20)
    block = token_block(n_tokens, rows, budget, logit_width)
    # the buffer (dC's temporaries, w E and the target term, sit in dE's rows before the dE GEMM
    # writes them); over several blocks the target rows
    during = block * shard * logit_width
    if low and block < n_tokens:
        during += min(n_tokens, rows) * h * 4
    if low:  # fp32 dE, the bf16 dC, and the larger of the above and the returned dE
        return n_tokens * h * 4 + shard * h * width + max(during, n_tokens * h * width)
    # fp32 dE and dC, and the larger of the above and the returned gradients
    return n_tokens * h * 4 + shard * h * 4 + max(during, outputs)


def activation_bytes(recipe: Recipe, *, layers: int, in_flight: int, width: int) -> float:
    """Estimated activation bytes of a pipeline stage of `layers` layers with `in_flight`
    micro-batches in flight, in a compute dtype of `width` bytes (see the module docstring)."""
    m, p = recipe.model, recipe.parallel
    sbh = recipe.train.micro_batch_size * m.seq_length * m.hidden_size * width / 2  # in units of 2 bytes
    tp = p.tensor
    per_layer = sbh * 34 / tp if p.sequence_parallel else sbh * (10 + 24 / tp)
    layer_input = 2 * sbh / (tp if p.sequence_parallel else 1)
    if m.recompute_granularity == "full":
        n = min(m.recompute_num_layers, layers)
        if m.recompute_method == "uniform":
            kept, transient = -(-layers // n) * layer_input, n * per_layer
        else:  # block
            kept, transient = n * layer_input + (layers - n) * per_layer, per_layer if n else 0
        return kept * in_flight + transient
    return per_layer * layers * in_flight


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:7.2f} {unit}"
    return f"{n:7.0f} B  "


def format_report(recipe: Recipe, r: dict) -> str:
    m, t = recipe.model, recipe.train
    lines = [
        f"recipe {r['recipe']}: valid for world size {r['world']} on {r['device']} ({r['dtype']})",
        (
            f"model: {r['params_total'] / 1e6:,.1f}M parameters; {m.num_layers} layers, hidden {m.hidden_size}, "
            f"{m.num_attention_heads} heads ({m.query_groups} kv), ffn {m.ffn_size}, seq {m.seq_length}, "
            f"vocab {r['vocab']} padded (tokenizer {r['tokenizer_vocab']}); loss {r['loss_impl']}"
        ),
        (
            f"layout: world {r['world']} = tp {r['tp']} x pp {r['pp']} x dp {r['dp']}"
            f"{' + sequence parallel' if recipe.parallel.sequence_parallel else ''}"
            f"{' + distributed optimizer' if recipe.parallel.distributed_optimizer else ''}"
            f"{f' + FSDP ({recipe.parallel.fsdp})' if recipe.parallel.fsdp != 'none' else ''}"
        ),
        (
            f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x accumulation {r['accumulation']} "
            f"x dp {r['dp']} ({r['tokens_per_step']:,} tokens/step); {r['flops_per_token'] / 1e6:,.1f} MFLOP/token"
        ),
    ]
    if r["world"] <= 16:
        coords = []
        for rank in range(r["world"]):
            tp_rank = rank % r["tp"]
            dp_rank = (rank // r["tp"]) % r["dp"]
            pp_rank = rank // (r["tp"] * r["dp"])
            coords.append(f"{rank}:(tp{tp_rank},pp{pp_rank},dp{dp_rank})")
        lines.append("ranks: " + " ".join(coords))
    for stage in r["stages"]:
        lines.append(
            f"stage {r['stages'].index(stage)} (rank {stage['rank']}): {stage['params_local'] / 1e6:,.2f}M parameters "
            f"per rank ({stage['embedding_local'] / 1e6:,.2f}M embedding/output), {stage['layers']} layers, "
            f"output layer {stage['output_layer']}"
        )
    lines.append("memory per rank (estimate):        " + "  ".join(f"stage {x['stage']:<8}" for x in r["memory"]))
    recompute = f", {m.recompute_granularity} recompute" if m.recompute_granularity else ""
    fsdp = recipe.parallel.fsdp != "none"
    for key, label in (
        ("weights", "weights (shard + gathered units)" if fsdp else "weights"),
        ("grads", "gradients (shard)" if fsdp else "gradients (fp32)"),
        ("optimizer", "Adam state (shard)" if fsdp else "Adam state"),
        ("activations", f"activations (approx.{recompute})"), ("loss_megatron", "loss layer, megatron: logits+grad fp32"),
        ("loss_cce", "loss layer, CCE: dE + dC bound"), ("total_megatron", "total with megatron loss"),
        ("total_cce", "total with CCE"),
    ):
        lines.append(f"  {label:<40}" + "  ".join(_bytes(x[key]) for x in r["memory"]))
    last = r["memory"][-1]
    if last["loss_cce"]:
        lines.append(
            f"  the loss layer needs {last['loss_megatron'] / max(last['loss_cce'], 1):,.1f}x less memory with CCE "
            f"({_bytes(last['loss_megatron']).strip()} -> {_bytes(last['loss_cce']).strip()} per micro-batch)"
        )
    save = r["save"]
    per_param = "12 bytes per parameter: fp32 main weights and two Adam moments" if recipe.parallel.fsdp == "megatron" else (
        f"{4 if r['dtype'] == 'float32' else 2} + 12 bytes per parameter: the weights, fp32 main weights and two Adam moments")
    lines.append(f"checkpoint: {grace.format_bytes(save['bytes'])} ({per_param}); a save takes about "
                 f"{grace.format_seconds(r['save_s'])} "
                 f"at {save['bytes_per_s'] / 1e9:.3g} GB/s ({save['source']})")
    lines.append(f"  on a signal: the step in progress, then up to {grace.format_seconds(save['on_signal_s'])} for "
                 f"{'the save in flight and ' if save['asynchronous'] else ''}the save; the launcher's grace should be at "
                 f"least {save['needed_s']} s (launch/*.sh and python -m cce_parallel.train wait that long; a bare "
                 "torchrun: --shutdown-timeout)")
    return "\n".join(lines)
