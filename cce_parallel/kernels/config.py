"""Launch parameters for the CCE kernels: fixed, sane defaults per device (no autotuning by default)."""

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and chunk budgets of the Triton passes around the library GEMMs.

    One-pass path (ops/one_pass.py; the default whenever gradients are needed): per block of
    tokens, the fused GEMM (kernels/probs_gemm.py) writes the softmax weights over the whole local
    vocabulary into a buffer of the caller's `logits_budget`, in probs_block_n x probs_block_v
    tiles, probs_block_d deep, probs_num_warps warps, probs_num_stages pipeline stages, over
    probs_programs persistent programs (one per SM). Its variant for fp16 (and softcap with label
    smoothing) keeps fp32 logits there: _stats_from_logits_kernel reads them once for the
    statistics, and _dz_rows_kernel turns them into the logit gradient in place, rows_block_n rows
    per program, rows_block_v columns per step, rows_num_warps warps.

    Lean path (logits_budget=0, and reduction "none" once a call got per-token weights): the
    forward's fp32 logit chunks hold at most fwd_chunk_bytes, the backward's chunk of fp32 logits
    plus logit gradient at most bwd_workspace_bytes; a chunk keeps at least
    dense_min_cols vocabulary columns, and past that the tokens are split into blocks instead
    (narrower chunks make the traffic grow as N^2). bwd_block_n / bwd_block_v / bwd_num_warps
    shape the lean backward's dz tiles.

    Statistics pass (both paths): fwd_block_n / fwd_block_v are the interpreter's tiles and
    fwd_block_v the chunks' column granularity; fwd_programs is how many programs it aims for.
    """

    fwd_block_n: int = 128
    fwd_block_v: int = 128
    fwd_programs: int = 528
    fwd_chunk_bytes: int = 64 << 20
    bwd_block_n: int = 128
    bwd_block_v: int = 128
    bwd_num_warps: int = 8
    bwd_workspace_bytes: int = 64 << 20
    dense_min_cols: int = 1024
    rows_block_n: int = 1
    rows_block_v: int = 2048
    rows_num_warps: int = 4
    probs_block_n: int = 128
    probs_block_v: int = 256
    probs_block_d: int = 64
    probs_num_warps: int = 8
    probs_num_stages: int = 3  # 4 x 48 KiB of operands + W's 64 KiB staging tile > an H100's 227 KiB
    probs_programs: int = 132

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        for name in ("fwd_block_n", "fwd_block_v", "bwd_block_n", "bwd_block_v", "rows_block_v", "probs_block_n",
                     "probs_block_v", "probs_block_d"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        if self.rows_block_n & (self.rows_block_n - 1):
            raise ValueError(f"KernelConfig.rows_block_n must be a power of two, got {self.rows_block_n}")


# Under TRITON_INTERPRET every program runs as numpy code: small blocks keep the odd test shapes
# spread over several tiles (so masking is exercised) without making the interpreter crawl.
INTERPRETER_CONFIG = KernelConfig(
    fwd_block_n=16, fwd_block_v=64, fwd_programs=8, bwd_block_n=16, bwd_block_v=64, bwd_num_warps=4,
    bwd_workspace_bytes=6000, fwd_chunk_bytes=6000, dense_min_cols=64, rows_block_n=2, rows_block_v=64,
    probs_block_n=16, probs_block_v=64, probs_block_d=16, probs_num_warps=4, probs_num_stages=1,
    probs_programs=3,
)


_ENV_OVERRIDE = "CCE_PARALLEL_KERNEL_CONFIG"


@functools.lru_cache(maxsize=None)
def _env_override(text: str) -> dict:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{_ENV_OVERRIDE} must be a JSON object of KernelConfig fields: {err}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{_ENV_OVERRIDE} must be a JSON object of KernelConfig fields, got {text!r}")
    unknown = set(fields) - {f.name for f in dataclasses.fields(KernelConfig)}
    if unknown:
        raise ValueError(f"{_ENV_OVERRIDE}: unknown KernelConfig field(s) {sorted(unknown)}")
    return fields


def default_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """The fixed defaults for a device and input dtype; the environment variable
    CCE_PARALLEL_KERNEL_CONFIG (a JSON object of field overrides, e.g. '{"bwd_block_n": 128}')
    replaces any field."""
    return _config(device, dtype, os.environ.get(_ENV_OVERRIDE))


@functools.lru_cache(maxsize=None)
def _config(device: torch.device, dtype: torch.dtype, text) -> KernelConfig:
    # Cached: building and validating the dataclass costs the host more than a kernel launch.
    if device.type != "cuda":
        cfg = INTERPRETER_CONFIG
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        cfg = replace(KernelConfig(), fwd_programs=4 * sms, probs_programs=sms)
        if dtype == torch.float32:  # fp32 operands and W: the bf16 tiling overflows shared memory
            cfg = replace(cfg, probs_block_v=128, probs_block_d=32)
    return replace(cfg, **_env_override(text)) if text else cfg
