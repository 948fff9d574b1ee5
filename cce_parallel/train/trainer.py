"""The training loop: build, (resume,) step, log, evaluate, checkpoint.

One step = the learning rate for step k, the recipe's micro-batches through the forward/backward
schedule, and one optimizer step. ``forward_step`` and ``loss_func`` are Megatron-LM's
``pretrain_gpt`` pair: the model returns the per-token fp32 loss [b, s] (CCE or megatron's
vocab_parallel_cross_entropy), masked by the dataset's loss_mask, summed, and reported with its
token count; the schedule divides by the token count and the number of micro-batches.
"""

import contextlib
import dataclasses
import datetime
import functools
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cce_parallel.config import Recipe, RecipeError, dump_recipe, recipe_to_dict
from cce_parallel.megatron import mask_labels
from cce_parallel.train import checkpoint, grace, launch
from cce_parallel.train.data import build_batches, prepare_on_rank0
from cce_parallel.train.engine import build_engine, schedule_change
from cce_parallel.train.metrics import MetricsLogger, end_summary, peak_memory_per_rank, peak_tflops
from cce_parallel.train.gpt import (
    build_gpt,
    count_parameters,
    flops_per_token,
    model_vocab_size,
    transformer_config,
)
from cce_parallel.train.signals import StopOnSignal


def forward_step(data_iterator, model, fold_mask: bool = False):
    batch = next(data_iterator)
    labels = batch["labels"]
    if fold_mask:
        # Masked tokens get CCE's ignore_index: zero loss (the mask zeroes it anyway) and no gradient,
        # so the upstream gradient is one number over the kept tokens and the one-pass loss only
        # scales the gradients it computed in the forward (cce_parallel.megatron.mask_labels).
        labels = mask_labels(labels, batch["loss_mask"])
    # loss_mask reaches the model for multi-token prediction, whose depths roll and apply it
    # themselves (megatron-core's GPTModel reads it for nothing else).
    loss = model(batch["tokens"], batch["position_ids"], None, labels=labels, loss_mask=batch["loss_mask"])
    return loss, functools.partial(loss_func, batch["loss_mask"], folded=fold_mask)


def loss_func(loss_mask: torch.Tensor, per_token: torch.Tensor, *, folded: bool = False):
    """(sum of the masked per-token losses, token count, report). folded: the mask is in the labels,
    so masked tokens' losses are exactly 0 and, the mask being 0/1 (Batches checks it), the plain
    sum is the masked one, bit for bit. Its gradient is then one number for every token, which the
    one-pass loss scales by without learning on the host whether a per-token gradient is uniform
    (a sync that leaves the GPU idle)."""
    mask = loss_mask.float()
    total = per_token.float().sum() if folded else (per_token.float() * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count])}


class Trainer:
    def __init__(self, recipe: Recipe, device: str, *, command: str = "", started: float | None = None):
        """started: time.monotonic() at the process's start (train.exit_duration counts from it)."""
        self.recipe, self.device, self.command = recipe, device, command
        self.started = time.monotonic() if started is None else started
        # From here on a signal is noted (not fatal): the run saves after its first step and exits.
        self.on_signal = StopOnSignal(recipe.checkpoint.signals, recipe.checkpoint.signal_deadline_s, device)
        self.layout = launch.init_distributed(recipe, device)
        self.rank0 = self.layout["rank"] == 0
        self.run_dir = Path(recipe.run.out_dir) / recipe.run.name
        self.ckpt_dir = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else self.run_dir / "checkpoints"
        self.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
            recipe.train.precision, torch.bfloat16 if device == "cuda" else torch.float32
        )
        self._lock = self._lock_run_dir()
        resume_from = self._find_resume()
        if self.rank0:
            (self.run_dir / "recipe.yaml").write_text(dump_recipe(recipe, header=f"resolved recipe\n{command}"))
            if resume_from is None and (self.run_dir / "metrics.jsonl").exists():
                os.replace(self.run_dir / "metrics.jsonl", self.run_dir / "metrics.jsonl.prev")
        dist.barrier()

        # Data (rank 0 prepares it once), then the model, wrapped, with its optimizer.
        from cce_parallel.data.tokenizer import load_tokenizer

        info = prepare_on_rank0(recipe.data)
        tokenizer = load_tokenizer(info)
        self.vocab_size = model_vocab_size(recipe, info.vocab_size)
        torch_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.train_batches, self.valid_batches = build_batches(
            recipe, info, tokenizer, dp_rank=self.layout["dp_rank"], dp_size=self.layout["dp"], device=torch_device
        )
        self.config = transformer_config(recipe, dtype=self.dtype, cpu_init=device == "cpu")
        # The schedule divides each micro-batch's loss by their number: the one-pass CCE loss makes a
        # bf16 ∇W for that from the first call (not learned at the first backward), so that a
        # resumed run computes the same bits as one that never stopped.
        self.loss_scale = 1.0 / self.layout["accumulation"] if recipe.loss.is_cce else None
        model = build_gpt(recipe, self.config, vocab_size=self.vocab_size, device=device,
                          loss_scale=self.loss_scale)
        self.info = info
        if recipe.model.init_from and resume_from is None:
            self._init_from(model, info)
        self.params_local, stage_params = count_parameters(model, recipe.parallel.tensor)
        self.params_total = self._total_parameters(stage_params)
        self.engine = build_engine(recipe, model, self.config, device=device, dtype=self.dtype)

        self.step = 0
        self.metrics = MetricsLogger(
            self.run_dir, recipe_to_dict(recipe), wandb_mode=recipe.logging.wandb,
            wandb_project=recipe.logging.wandb_project, run_name=recipe.run.name,
        )
        if resume_from is not None:
            start = time.perf_counter()
            meta = checkpoint.load(resume_from, engine=self.engine, layout=self.layout)
            self.step = meta["step"]
            seconds = time.perf_counter() - start
            self.metrics.print(f"resumed from {resume_from} at step {self.step} (checked in {self._verify_s:.1f} s, "
                               f"loaded in {seconds:.1f} s)")
            self.metrics.record("resume", step=self.step, path=str(resume_from), verify_s=self._verify_s, load_s=seconds)
            change = schedule_change(meta["scheduler"], self.engine.scheduler, recipe)
            if change is not None:  # e.g. train.steps raised on a finished run: the decay is stretched
                self._warn(f"warning: {resume_from.name}: {change.describe()}")
                self.metrics.record("schedule_change", step=self.step, **change.to_json())
        self.checkpointer = checkpoint.Checkpointer(
            self.ckpt_dir, keep=recipe.checkpoint.keep, timeout=datetime.timedelta(minutes=recipe.run.dist_timeout_minutes)
        )
        self.start_step = self.step
        self.flops_per_token = flops_per_token(recipe, self.vocab_size)
        self.peak_tflops = peak_tflops(recipe.logging.peak_tflops, device)
        self._record_meta(info)
        self.stopped: dict | None = None  # how train() ended: step, reason, checkpoint
        self._last_checkpoint = str(resume_from) if resume_from is not None else None
        self._step_s: float | None = None
        self._last_train: dict | None = None  # for the summary at the end
        self._last_eval: dict | None = None
        self._train_s = 0.0  # the steps' time, this start
        self._warned_need = 0
        self.grace = grace.launcher_grace()
        self.save_estimate = self._first_save_estimate(resume_from)
        self._check_grace(self.save_estimate, at_start=True)

    # -- setup helpers ---------------------------------------------------------------------

    def _lock_run_dir(self) -> int | None:
        """Rank 0 holds the run directory's lock; every rank raises if another run holds it."""
        fd, problem = None, [None]
        if self.rank0:
            try:
                fd = checkpoint.lock_run_dir(self.run_dir)
            except checkpoint.CheckpointError as err:
                problem = [str(err)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise RecipeError(f"run.name: {problem[0]}; stop it or choose another run.name")
        return fd

    def _find_resume(self) -> Path | None:
        """The checkpoint to resume from, checked (collective)."""
        start = time.perf_counter()
        try:
            return self._checked_resume()
        finally:
            self._verify_s = time.perf_counter() - start

    def _checked_resume(self) -> Path | None:
        resume = self.recipe.checkpoint.resume
        if resume == "never":
            if checkpoint.checkpoints(self.ckpt_dir):
                raise RecipeError(
                    f"checkpoint.resume: never, but {self.ckpt_dir} holds checkpoints; remove them, choose another "
                    "run.name, or resume (checkpoint.resume=auto)"
                )
            return None
        try:
            if resume == "auto":
                return checkpoint.newest_valid(self.ckpt_dir, warn=self._warn)
            checkpoint.verify_collective(resume)
            return Path(resume)
        except checkpoint.CheckpointError as err:
            raise RecipeError(f"checkpoint.resume: {resume}: {err}") from None

    def _init_from(self, model, info):
        """model.init_from: this rank's shards of a transformers checkpoint (cce_parallel.hf)."""
        from cce_parallel.hf.convert import ConversionError
        from cce_parallel.hf.load import load_hf

        start = time.perf_counter()
        try:
            report = load_hf(model, self.recipe, self.recipe.model.init_from, tokenizer_vocab=info.vocab_size)
        except ConversionError as err:
            message = str(err)
            raise RecipeError(message if message.startswith("model.") else f"model.init_from: {message}") from None
        if self.rank0:
            print(f"initialized from {report['path']} ({report['architecture']}, {report['tensors']} tensors on rank 0, "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)

    def _first_save_estimate(self, resume_from: Path | None) -> grace.SaveEstimate:
        """How long a save will take (grace.py): the resumed checkpoint's bytes, or the parameters'
        (each stored once), at the speed the run directory's earlier saves measured (collective;
        rank 0 reads the run directory and tells the others)."""
        stored = torch.tensor([float(self.params_local if self.layout["dp_rank"] == 0 else 0)], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(stored)
        found = [None]
        if self.rank0:
            nbytes = None
            if resume_from is not None:
                with contextlib.suppress(checkpoint.CheckpointError, OSError, KeyError, ValueError):
                    nbytes = sum(f["bytes"] for f in checkpoint.read_meta(resume_from)["files"].values())
            if nbytes is None:
                width = torch.empty((), dtype=self.dtype).element_size()
                nbytes = grace.checkpoint_bytes(int(stored.item()), width, self.recipe.parallel.fsdp)
            found = [grace.estimate(nbytes, run_dir=self.run_dir, asynchronous=self.recipe.checkpoint.asynchronous)]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def _check_grace(self, estimate: grace.SaveEstimate, *, at_start: bool = False):
        """Tell the launcher's agent what a save on a signal needs; at start-up say what it has, and
        warn (rank 0) where the grace is too short, again when a save measured it longer."""
        grace.report_to_agent(estimate)
        if not self.rank0:
            return
        warning = grace.check(estimate, self.grace)
        if at_start:
            if self.grace.by_agent:
                has = (f"the launcher's agent waits {self.grace.seconds:.0f} s after a signal, longer where the save "
                       f"needs it ({estimate.needed_s} s now)")
            elif self.grace.seconds is None:
                has = "no launcher agent: the scheduler's grace applies"
            else:
                has = f"torchrun SIGKILLs the ranks {self.grace.seconds:.0f} s after a signal ({self.grace.source})"
            self.metrics.print(f"{estimate.describe()}; {has}")
        if warning and estimate.needed_s > self._warned_need:
            self._warned_need = math.ceil(estimate.needed_s * 1.2)  # once, unless it grows
            print(warning, file=sys.stderr, flush=True)
            self.metrics.record("grace_warning", step=self.step, grace_s=self.grace.seconds, **estimate.to_json())

    def _warn(self, line: str):
        if self.rank0:
            print(line, file=sys.stderr, flush=True)

    def _total_parameters(self, stage_params: int) -> int:
        """Parameters of the whole model: the stages' sums over their TP groups, without the
        output-layer copy of a tied embedding on the last stage."""
        counts = torch.zeros(self.layout["pp"], dtype=torch.float64, device=self.device)
        if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            counts[parallel_state.get_pipeline_model_parallel_rank()] = stage_params
        dist.all_reduce(counts)
        total = int(counts.sum().item())
        if self.layout["pp"] > 1 and self.recipe.model.tie_embeddings:
            total -= self.vocab_size * self.recipe.model.hidden_size
        return total

    @property
    def _loss_fusion(self) -> str | None:
        c = self.config
        return c.cross_entropy_fusion_impl if c.cross_entropy_loss_fusion else None

    def _record_meta(self, info):
        import megatron.core

        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                    check=False, cwd=Path(__file__).resolve().parent).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        self.metrics.record(
            "meta", step=self.step, command=self.command, recipe=recipe_to_dict(self.recipe), layout=self.layout,
            device=self.device, device_name=name, dtype=str(self.dtype).replace("torch.", ""),
            engine=self.engine.kind, params_total=self.params_total, params_rank0=self.params_local,
            vocab_size=self.vocab_size, tokenizer_vocab_size=info.vocab_size, dataset=info.out_dir,
            flops_per_token=flops_per_token(self.recipe, self.vocab_size), peak_tflops=self.peak_tflops,
            torch=torch.__version__, megatron_core=megatron.core.__version__, python=sys.version.split()[0],
            commit=commit, host=socket.gethostname(), time=time.time(),
            loss_scale=self.loss_scale,  # what a bf16 ∇W made in the CCE loss's forward is made for
            loss_fusion=self._loss_fusion,  # megatron_fused: the cross_entropy_fusion_impl it ran (native / te)
        )
        r = self.recipe
        self.metrics.print(
            f"{r.run.name}: {self.params_total / 1e6:.2f}M parameters ({self.params_local / 1e6:.2f}M on rank 0), "
            f"vocab {self.vocab_size} (tokenizer {info.vocab_size}), loss {r.loss.impl}"
            f"{f' ({self._loss_fusion})' if self._loss_fusion else ''}, {self.device} "
            f"{str(self.dtype).replace('torch.', '')}; world {self.layout['world']} = tp {self.layout['tp']} x "
            f"pp {self.layout['pp']} x dp {self.layout['dp']}; {self.layout['accumulation']} micro-batches of "
            f"{r.train.micro_batch_size} per rank per step; run dir {self.run_dir}"
        )

    # -- the loop ------------------------------------------------------------------------------

    def _run_batches(self, batches, first_sample: int, forward_only: bool):
        r = self.recipe
        return self.engine.forward_backward(
            forward_step_func=functools.partial(forward_step, fold_mask=r.loss.is_cce),
            data_iterator=batches.microbatches(first_sample),
            model=self.engine.model,
            num_microbatches=self.layout["accumulation"],
            seq_length=r.model.seq_length,
            micro_batch_size=r.train.micro_batch_size,
            decoder_seq_length=r.model.seq_length,
            forward_only=forward_only,
        )

    def _reduce(self, reports_list) -> tuple[float, float]:
        """(loss sum, token count) over all micro-batches and data-parallel ranks, on every rank."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for reports in reports_list:
            for report in reports:
                total += report["lm loss"].to(total)
        if parallel_state.is_pipeline_last_stage():
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        if self.layout["pp"] > 1:  # only the last stage has losses: sum them to every stage
            dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return total[0].item(), total[1].item()

    def train_step(self) -> dict:
        r, engine = self.recipe, self.engine
        start = time.perf_counter()
        engine.scheduler.step(1)  # the learning rate of step self.step + 1
        lr = engine.optimizer.param_groups[0]["lr"]
        engine.zero_grad()
        reports = self._run_batches(self.train_batches, self.step * r.train.global_batch_size, forward_only=False)
        ok, grad_norm, _ = engine.optimizer.step()
        loss_sum, tokens = self._reduce([reports])
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.step += 1
        step_time = time.perf_counter() - start
        tokens_per_s = r.train.global_batch_size * r.model.seq_length / step_time
        mfu = None
        if self.peak_tflops:
            mfu = tokens_per_s * self.flops_per_token / (self.layout["world"] * self.peak_tflops * 1e12)
        return {
            "step": self.step, "loss": loss_sum / max(tokens, 1), "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan, "update": bool(ok),
            "step_time": step_time, "tokens_per_s": tokens_per_s, "mfu": mfu,
            "consumed_samples": self.step * r.train.global_batch_size, "time": time.time(),
            "elapsed_s": time.monotonic() - self.started,
            "tokens": self.step * r.train.global_batch_size * r.model.seq_length,
        }

    @torch.no_grad()
    def evaluate(self) -> dict:
        r = self.recipe
        self.engine.train(False)
        reports = [
            self._run_batches(self.valid_batches, i * r.train.global_batch_size, forward_only=True)
            for i in range(r.eval.iters)
        ]
        self.engine.train(True)
        loss_sum, tokens = self._reduce(reports)
        val_loss = loss_sum / max(tokens, 1)
        return {"step": self.step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": int(tokens)}

    def save(self, *, lean: bool = False):
        """Start a checkpoint of this step; training goes on once the state is in host memory.
        lean (always with checkpoint.lean): without the model weights the main weights hold."""
        meta = {"layout": self.layout, "recipe": recipe_to_dict(self.recipe), "loss_impl": self.recipe.loss.impl,
                "vocab_size": self.vocab_size, "tokenizer_vocab_size": self.info.vocab_size,
                "dataset": self.info.out_dir}
        start = time.perf_counter()
        self._log_saved(self.checkpointer.wait())  # the one before, unless it is done
        waited = time.perf_counter() - start
        blocked = waited + self.checkpointer.save(
            step=self.step, consumed_samples=self.step * self.recipe.train.global_batch_size, engine=self.engine,
            meta=meta, lean=lean or self.recipe.checkpoint.lean,
        )
        if self.recipe.checkpoint.asynchronous:
            self.metrics.record("checkpoint_start", step=self.step, blocked_s=blocked, waited_s=waited)
            self.metrics.print(f"checkpoint of step {self.step}: training blocked {blocked:.1f} s "
                               f"({waited:.1f} s of it waiting for the previous one), writing in the background")
        else:
            self._log_saved(self.checkpointer.wait(), blocking=True)

    def _log_saved(self, report: dict | None, *, blocking: bool = False):
        """Log a checkpoint that has been written: how long training was blocked (blocking: the
        whole save), how long the write took after that, and its throughput (the whole checkpoint
        over all ranks)."""
        if not report:
            return
        if blocking:
            report["blocked_s"] = report["total_s"]
        self._last_checkpoint = report["path"]
        if report.get("bytes") and report.get("total_s"):
            self.save_estimate = grace.SaveEstimate(
                bytes=report["bytes"], bytes_per_s=report["bytes"] / report["total_s"],
                source=f"measured on the save of step {report['step']}", step_s=self._step_s or 0.0,
                asynchronous=self.recipe.checkpoint.asynchronous)
            self._check_grace(self.save_estimate)
        rate = report["bytes"] / max(report["total_s"] - (0.0 if blocking else report["blocked_s"]), 1e-9)
        fields = {k: report[k] for k in ("path", "blocked_s", "stage_s", "write_s", "publish_s", "prune_s", "pruned",
                                         "total_s", "bytes", "read_back")}
        self.metrics.record("checkpoint", step=report["step"], seconds=report["blocked_s"], write_gb_per_s=rate / 1e9,
                            **fields)
        self.metrics.print(
            f"saved checkpoint {report['path']}: {report['bytes'] / 1e9:.2f} GB, training blocked "
            f"{report['blocked_s']:.1f} s (staging {report['stage_s']:.1f} s), written in {report['total_s']:.1f} s "
            f"({rate / 1e9:.2f} GB/s; meta.json and rename {report['publish_s']:.2f} s)"
        )
        for path in report["pruned"]:
            self.metrics.print(f"removed checkpoint {path} (checkpoint.keep: {self.recipe.checkpoint.keep})")

    def _eval_and_log(self):
        result = self._last_eval = self.evaluate()
        self.metrics.record("eval", **result)
        self.metrics.print(f"eval at step {result['step']}: val loss {result['val_loss']:.4f} | val ppl {result['val_ppl']:.2f}")

    def train(self):
        r = self.recipe
        stop = r.train.stop_at or r.train.steps
        if self.step >= r.train.steps:
            self.metrics.print(f"nothing to do: the checkpoint is at step {self.step} of {r.train.steps}")
            self._stop("done")
            return
        if self.step > 0:  # resumed: the optimizer has its state already
            # The first save after a restart blocked 6.0 s instead of 1.3 s on 4x H100 (Gemma 2 2B,
            # 3 steps in) while its buffers were still allocated after the first step.
            self.checkpointer.prepare(self.engine)
        try:
            while self.step < stop:
                result = self.train_step()
                self._step_s = result["step_time"]
                self._last_train = result
                self._train_s += result["step_time"]
                if self.step % r.logging.interval == 0 or self.step in (1, stop):
                    result["peak_mem_per_rank"] = peak_memory_per_rank(self.device)
                    result["peak_mem_max"] = max(result["peak_mem_per_rank"])
                    self.metrics.train_line(dict(result, device=self.device), r.train.steps)
                self.metrics.record("train", **result)
                if self.step == self.start_step + 1:
                    self.checkpointer.prepare(self.engine)  # host buffers for the saves, in the background (once)
                if not math.isfinite(result["loss"]):
                    raise FloatingPointError(f"the loss is {result['loss']} at step {self.step}")
                self._log_saved(self.checkpointer.poll())
                reason = self._stop_reason()
                if reason is not None:
                    self.save(lean=True)  # what resuming needs, sooner: a grace period is short
                    self._log_saved(self.checkpointer.wait())
                    self._stop(reason)
                    return
                if self.step == r.train.steps or (r.eval.interval and self.step % r.eval.interval == 0):
                    self._eval_and_log()
                last = self.step == stop and (r.checkpoint.at_end or stop < r.train.steps)
                if last or (r.checkpoint.interval and self.step % r.checkpoint.interval == 0):
                    self.save()
            self._log_saved(self.checkpointer.wait())
        finally:
            self.on_signal.restore()
        self._stop("stop_at" if self.step < r.train.steps else "done")

    def _stop_reason(self) -> str | None:
        """Collective, after each step: "signal" when any rank got one of checkpoint.signals,
        "exit_duration" when on any rank another step and a save (its estimate) would end after
        train.exit_duration; None to go on."""
        r = self.recipe
        if not r.checkpoint.signals and r.train.exit_duration is None:
            return None
        time_up = False
        if r.train.exit_duration is not None:
            ahead = dataclasses.replace(self.save_estimate, step_s=self._step_s or 0.0).on_signal_s
            time_up = time.monotonic() - self.started + ahead > r.train.exit_duration * 60
        return self.on_signal.agreed(time_up)

    def _stop(self, reason: str):
        """Log how training ended; ``stopped`` tells the entry point (and the launcher's agent)."""
        elapsed = time.monotonic() - self.started
        self.stopped = {"step": self.step, "reason": reason, "checkpoint": self._last_checkpoint}
        t, e = self._last_train or {}, self._last_eval or {}
        self.metrics.record("stop", step=self.step, reason=reason, checkpoint=self._last_checkpoint, elapsed_s=elapsed,
                            train_s=self._train_s, tokens=self.step * self._tokens_per_step,
                            train_loss=t.get("loss"), train_loss_step=t.get("step"), val_loss=e.get("val_loss"),
                            val_loss_step=e.get("step"))
        if reason != "done":
            why = {"signal": "on a signal", "stop_at": "(train.stop_at)"}.get(reason) or (
                f"(train.exit_duration: {self.recipe.train.exit_duration:g} min would pass before another step and its "
                f"save; {elapsed / 60:.2f} min in)")
            saved = "checkpoint written" if self._last_checkpoint else "no checkpoint"
            self.metrics.print(f"stopped at step {self.step} {why}, {saved}; start again to resume")
        self.metrics.print(end_summary(
            name=self.recipe.run.name, finished=self.step >= self.recipe.train.steps, step=self.step, steps=self.recipe.train.steps, start_step=self.start_step,
            tokens_per_step=self._tokens_per_step, elapsed_s=elapsed, train_s=self._train_s, train=self._last_train,
            val=self._last_eval, checkpoint=self._last_checkpoint, run_dir=self.run_dir))

    @property
    def _tokens_per_step(self) -> int:
        return self.recipe.train.global_batch_size * self.recipe.model.seq_length

    def close(self, *, failed: bool = False):
        """Tear down. After a failure a checkpoint still being written is abandoned (the other
        ranks may be gone); it stays a .tmp_ directory and the previous one stays the newest."""
        if not failed:
            self._log_saved(self.checkpointer.wait())
        self.metrics.close()
        if self._lock is not None:
            os.close(self._lock)
        launch.shutdown()

