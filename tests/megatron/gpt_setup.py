"""A tiny megatron-core GPTModel, trained one step by Megatron's own path and by CCE, in a test worker.

Both models are built from the same seed with ``use_cpu_initialization`` (so every rank computes
the same master weights and takes its shard, whatever the parallel layout) and
``cce_parallel.megatron.local_gpt_block_spec`` (SDPA attention, torch norms: no TE, no apex). The
reference keeps megatron-core's ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``; the
other gets ``use_cce``. ``train_step`` runs one step the way Megatron-LM's ``pretrain_gpt`` does:
per-token loss [b, s] × loss_mask, summed and divided by the number of tokens, then DDP's
``finalize_model_grads`` (DP reduction, sequence-parallel norm grads, tied-embedding grads across
pipeline stages), and an optimizer step where asked.

On GPUs the step goes through megatron-core's pipeline schedules (``get_forward_backward_func``).
On CPU (gloo) those, the DistributedOptimizer and the default RNG tracker need CUDA, so
``install_cpu_shims`` lets DDP allocate its buffers on the CPU and ``train_step`` drives the
pipeline stages itself (one micro-batch at a time, send/recv between stages).
"""

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Setup:
    """One parallel layout and model; world = tp · pp · dp."""

    name: str
    tp: int = 1
    pp: int = 1
    sp: bool = False
    tied: bool = False
    vocab: int = 128  # the model's (padded) vocabulary
    label_vocab: int | None = None  # labels are drawn below this (the real vocabulary); default vocab
    dtype: torch.dtype = torch.float32
    ddp: bool = False
    overlap: bool = False  # DDP overlap_grad_reduce
    distopt: bool = False  # distributed optimizer (GPU only)
    overlap_param_gather: bool = False  # with distopt
    fusion: bool = True  # gradient_accumulation_fusion on the CCE layer (main_grad); needs ddp
    convert_after_ddp: bool = False  # call use_cce on the DDP-wrapped model
    steps: int = 1  # optimizer steps (> 1 needs an optimizer: GPU only)
    microbatches: int = 1
    seq: int = 16
    mbs: int = 2
    layers: int = 2
    hidden: int = 32
    heads: int = 4
    ignore_frac: float = 0.0  # labels set to ignore_index (CCE) / masked out (both)
    cpu_init: bool = True  # use_cpu_initialization: the same weights whatever the layout (False: on GPU)


# ---------------------------------------------------------------------------------------------
# Process-level setup


class _NoStream:
    """Stands in for a CUDA stream on CPU, where work runs in issue order (no events to wait for)."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class _NoRNGTracker:
    """Stands in for megatron-core's CUDA RNG tracker on CPU (the tests use no dropout)."""

    def is_initialized(self):
        return True

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def install_cpu_shims():
    """Let megatron-core's model construction and DDP run on CPU tensors (test workers only).

    - DDP allocates its grad buffers on ``torch.cuda.current_device()``: make that the CPU.
    - DDP's gradient reduction (megatron-core >= 0.17) first syncs with
      ``torch.cuda.current_stream()``: a stream that waits for nothing.
    - GPTModel moves a tied embedding to ``.cuda()`` before all-reducing it across stages: no-op.
    - Sequence parallelism forks the CUDA RNG tracker in the embedding: a no-op tracker.
    """
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    mrandom._CUDA_RNG_STATE_TRACKER = _NoRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def init_parallel(setup: Setup, device: torch.device):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=setup.tp, pipeline_model_parallel_size=setup.pp
    )
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


def make_config(setup: Setup):
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = setup.dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=setup.layers * setup.pp,
        hidden_size=setup.hidden,
        num_attention_heads=setup.heads,
        ffn_hidden_size=4 * setup.hidden,
        tensor_model_parallel_size=setup.tp,
        pipeline_model_parallel_size=setup.pp,
        sequence_parallel=setup.sp,
        use_cpu_initialization=setup.cpu_init,
        params_dtype=setup.dtype,
        pipeline_dtype=setup.dtype,
        bf16=bf16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,  # needs apex; the CCE layer gets it set directly
        persist_layer_norm=False,
        apply_rope_fusion=False,
        init_method_std=0.05,
    )


# ---------------------------------------------------------------------------------------------
# Models


@dataclasses.dataclass
class Built:
    model: torch.nn.Module  # what train_step calls (DDP / Float16Module wrapped, or the GPTModel)
    gpt: torch.nn.Module  # the GPTModel inside
    config: object
    optimizer: object = None


def build(setup: Setup, device: torch.device, cce: dict | None = None, seed: int = 1) -> Built:
    """The GPTModel of this rank's pipeline stage; with `cce` (use_cce options) switched to CCE."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    from cce_parallel.megatron import local_gpt_block_spec, use_cce

    config = make_config(setup)
    torch.manual_seed(seed)
    gpt = GPTModel(
        config,
        local_gpt_block_spec(config),
        vocab_size=setup.vocab,
        max_sequence_length=setup.seq,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=setup.tied,
    )
    if cce is not None and not setup.convert_after_ddp:
        use_cce(gpt, **cce)
    model = gpt.to(device)
    if setup.dtype == torch.bfloat16:
        model = Float16Module(config, model)
    if setup.ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=setup.overlap,
            use_distributed_optimizer=setup.distopt,
            overlap_param_gather=setup.overlap_param_gather,
            bucket_size=2000 if setup.overlap else None,  # several buckets: reductions overlap backward
        )
        model = DistributedDataParallel(config, ddp_config, model)
        if setup.overlap:
            config.no_sync_func = model.no_sync
            config.grad_sync_func = model.start_grad_sync
    if cce is not None and setup.convert_after_ddp:
        use_cce(model, **cce)
    if cce is not None and setup.ddp and setup.fusion and gpt.post_process:
        gpt.output_layer.gradient_accumulation_fusion = True
    optimizer = None
    if setup.steps > 1 or setup.distopt:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        # Adam (the distributed optimizer takes no other) with a large eps: a step is then nearly
        # linear in small gradients, so that bf16 noise in near-zero gradients cannot flip them.
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=1e-3,
            adam_eps=1e-2,
            weight_decay=0.0,
            bf16=setup.dtype == torch.bfloat16,
            params_dtype=setup.dtype,
            use_distributed_optimizer=setup.distopt,
            clip_grad=0.0,
            overlap_param_gather=setup.overlap_param_gather,
        )
        optimizer = get_megatron_optimizer(opt_config, [model])
    return Built(model=model, gpt=gpt, config=config, optimizer=optimizer)


# ---------------------------------------------------------------------------------------------
# Data and one training step


def make_batches(setup: Setup, device: torch.device, step: int = 0, ignore_index: int = -100) -> list:
    """Micro-batches: the same on every rank of a model replica, different across DP ranks."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_rank()
    g = torch.Generator().manual_seed(1000 * step + 17 * dp + 5)
    batches = []
    for _ in range(setup.microbatches):
        tokens = torch.randint(0, setup.label_vocab or setup.vocab, (setup.mbs, setup.seq + 1), generator=g)
        loss_mask = (torch.rand(setup.mbs, setup.seq, generator=g) >= setup.ignore_frac).float()
        loss_mask[0, 0] = 1.0  # never an empty batch
        labels = tokens[:, 1:].clone()
        cce_labels = torch.where(loss_mask > 0, labels, torch.full_like(labels, ignore_index))
        batches.append(
            {
                "tokens": tokens[:, :-1].to(device),
                "position_ids": torch.arange(setup.seq).expand(setup.mbs, -1).to(device),
                "labels": labels.to(device),  # Megatron's path: in range everywhere, masked by loss_mask
                "cce_labels": cce_labels.to(device),  # CCE with ignore_frac: ignore_index where masked
                "loss_mask": loss_mask.to(device),
            }
        )
    return batches


def _loss_func(loss_mask, store, output_tensor):
    """Megatron-LM's pretrain_gpt loss: sum(per-token loss × mask), and the number of tokens.

    Stores the masked per-token loss [b, s] (what the step trains on) for the comparison.
    """
    store.append(output_tensor.detach().float() * loss_mask.view_as(output_tensor))
    losses = output_tensor.float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses.reshape(-1) * mask)
    return loss, mask.sum().to(torch.int), {"lm loss": loss.detach()}


def train_step(
    setup: Setup,
    built: Built,
    batches: list,
    device: torch.device,
    label_key: str = "labels",
    schedule=None,
    collect: bool = True,
) -> dict:
    """One forward/backward (+ finalize_model_grads, + optimizer step if any).

    schedule: run megatron-core's pipeline schedule (default: on CUDA), else drive stages by hand.
    collect=False skips the fp32 copies of the gradients and parameters (memory measurements).

    Returns {"loss": [per-micro-batch [b, s] losses] (last stage, else []), "grads": {name: grad},
    "params": {name: param after the step} (with an optimizer)}. Grads are main_grad under DDP.
    """
    from megatron.core.distributed import finalize_model_grads

    model = built.model
    if setup.ddp:
        model.zero_grad_buffer()
    if built.optimizer is not None:
        built.optimizer.zero_grad()
    for p in built.gpt.parameters():
        p.grad = None
    store = []
    if schedule if schedule is not None else device.type == "cuda":
        _schedule_step(setup, built, batches, store, label_key)
    else:
        _manual_step(setup, built, batches, store, label_key)
    if setup.ddp:
        finalize_model_grads([model])
    grads = {}
    for name, p in built.gpt.named_parameters() if collect else ():
        g = getattr(p, "main_grad", None) if setup.ddp else p.grad
        grads[name] = None if g is None else g.detach().float().clone()
    out = {"loss": store, "grads": grads, "params": {}}
    if built.optimizer is not None:
        ok, _, _ = built.optimizer.step()
        assert ok, "optimizer step skipped"
        if collect:
            out["params"] = {n: p.detach().float().clone() for n, p in built.gpt.named_parameters()}
    return out


def _schedule_step(setup, built, batches, store, label_key):
    import functools

    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b[label_key])
        return out, functools.partial(_loss_func, b["loss_mask"], store)

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[built.model],
        num_microbatches=len(batches),
        seq_length=setup.seq,
        micro_batch_size=setup.mbs,
        forward_only=False,
    )


def _manual_step(setup, built, batches, store, label_key):
    """The pipeline schedule by hand (CPU): stage by stage, one micro-batch at a time.

    The loss is scaled as megatron-core's schedule does: / num_tokens / num_microbatches.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    model = built.model
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_rank, pp = parallel_state.get_pipeline_model_parallel_rank(), setup.pp
    ranks = dist.get_process_group_ranks(pp_group)
    s_local = setup.seq // (setup.tp if setup.sp else 1)
    act_shape = (s_local, setup.mbs, setup.hidden)
    no_sync = model.no_sync if setup.ddp else contextlib.nullcontext
    for i, b in enumerate(batches):
        last_mb = i == len(batches) - 1
        ctx = contextlib.nullcontext() if last_mb else no_sync()
        with ctx:
            inp = None
            if pp_rank > 0:
                inp = torch.empty(act_shape, dtype=setup.dtype)
                dist.recv(inp, src=ranks[pp_rank - 1], group=pp_group)
                inp.requires_grad_()
                get_attr_wrapped_model(model, "set_input_tensor")(inp)
            out = model(
                b["tokens"], b["position_ids"], None, labels=b[label_key] if pp_rank == pp - 1 else None
            )
            if pp_rank < pp - 1:
                dist.send(out.detach().contiguous(), dst=ranks[pp_rank + 1], group=pp_group)
                grad = torch.empty_like(out)
                dist.recv(grad, src=ranks[pp_rank + 1], group=pp_group)
                out.backward(grad)
            else:
                loss, num_tokens, _ = _loss_func(b["loss_mask"], store, out)
                (loss / num_tokens.clamp(min=1) / len(batches)).backward()
            if pp_rank > 0:
                dist.send(inp.grad.contiguous(), dst=ranks[pp_rank - 1], group=pp_group)


def options_reference(gpt, softcap=None, label_smoothing=0.0, z_loss=0.0, ignore_index=-100, **unused):
    """Make a reference GPTModel's loss: Megatron's logits, gathered over tensor-parallel ranks
    (differentiable), then CCE's loss options in plain PyTorch, fp32. For options Megatron lacks."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    def loss_fn(labels, logits):  # labels [b, s], logits [s, b, V/tp] -> loss [b, s]
        z = gather_from_tensor_model_parallel_region(logits, group=gpt.tp_group).float().transpose(0, 1)
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        lse = torch.logsumexp(z, dim=-1)
        keep = labels != ignore_index
        target = z.gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)
        loss = (1 - label_smoothing) * (lse - target) + label_smoothing * (lse - z.mean(-1)) + z_loss * lse**2
        return torch.where(keep, loss, torch.zeros_like(loss))

    gpt.compute_language_model_loss = loss_fn


# ---------------------------------------------------------------------------------------------
# Comparison


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (||x|| when ref is zero); inf for non-finite x."""
    x, ref = x.double(), ref.double().to(x.device)
    if not bool(torch.isfinite(x).all()):
        return math.inf
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else x.norm().item()


def compare(cce: dict, ref: dict) -> dict:
    """{"loss": worst rel err over micro-batches, "grad": worst over params, "grad_name": which,
    "param": worst param rel err after the step (if any), "grads" / "params": {name: rel err}};
    a gradient present on one side only counts as inf."""
    out = {"loss": 0.0, "grad": 0.0, "grad_name": None, "param": 0.0, "grads": {}, "params": {}}
    assert len(cce["loss"]) == len(ref["loss"]), "different number of micro-batch losses"
    for a, b in zip(cce["loss"], ref["loss"]):
        assert a.shape == b.shape, f"loss shape {tuple(a.shape)} != reference {tuple(b.shape)}"
        out["loss"] = max(out["loss"], rel_err(a, b))
    assert cce["grads"].keys() == ref["grads"].keys(), "the models' parameters differ"
    for name, b in ref["grads"].items():
        a = cce["grads"][name]
        if a is None or b is None:
            err = 0.0 if a is None and b is None else math.inf
        else:
            err = rel_err(a, b)
        out["grads"][name] = err
        if err >= out["grad"]:
            out["grad"], out["grad_name"] = err, name
    for name, b in ref["params"].items():
        out["params"][name] = rel_err(cce["params"][name], b)
        out["param"] = max(out["param"], out["params"][name])
    return out
