"""Launch parameters for the CCE kernels: fixed, sane defaults per device (no autotuning by default)."""

import dataclasses
import functools
import json
import os
from dataclasses import dataclass, replace

import torch


_MAY_BE_ZERO = ("bwd_filter_by_max", "bwd_workspace_bytes", "bwd_dense_gemm", "fwd_dense_gemm")


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch settings for the forward and backward kernels.

    fwd_dense_gemm=1 (the default) computes the forward's logits one vocabulary chunk at a time
    with a library GEMM into an fp32 buffer of at most fwd_chunk_bytes (at least N x fwd_block_v
    floats), which one Triton pass folds into the log-sum-exp statistics (kernels/from_logits.py).
    fwd_dense_gemm=0 runs the fused Triton forward (kernels/lse_forward.py), which needs no buffer;
    fwd_programs is the number of programs it aims for (it sets how many vocabulary splits each
    token block gets).

    bwd_workspace_bytes > 0 (the default) selects the workspace backward (kernels/backward_ws.py)
    for every Triton impl: the logit gradient of one vocabulary chunk is staged in a workspace of at
    most that many bytes and summed into dE and dC by GEMMs, with no atomics. With bwd_dense_gemm=1
    (the default) those are the library's dense GEMMs (cuBLAS, fp32 accumulation), the logits are
    recomputed the same way as the dense forward's (the budget then holds the fp32 logits and the
    logit gradient of a chunk), and no tile is filtered, as skipping tiles would save nothing. On
    both dense passes a chunk keeps at least dense_min_cols vocabulary columns: past that, the
    tokens are split into blocks instead (narrower chunks make the traffic grow as N^2).
    bwd_dense_gemm=0 uses the Triton block-sparse GEMMs, which skip the tiles the impl's gradient
    filter drops. bwd_workspace_bytes=0 selects
    the tile-wise backward (kernels/backward.py), which needs less memory (no workspace, and for
    "cce" no fp32 dE buffer over all tokens) but is 3-18x slower on an H200. There, bwd_v_chunks is
    how many launches the buffered modes (fp32 / fixed point) split the vocabulary into, so that
    their dC buffer is 1/bwd_v_chunks of dC, and bwd_de_chunk_bytes bounds cce's fp32 dE buffer.
    """

    fwd_block_n: int = 128
    fwd_block_v: int = 128
    fwd_block_d: int = 128
    fwd_num_warps: int = 8
    fwd_num_stages: int = 3
    fwd_programs: int = 528
    fwd_dense_gemm: int = 1
    fwd_chunk_bytes: int = 64 << 20
    bwd_block_n: int = 128
    bwd_block_v: int = 128
    bwd_block_d: int = 64
    bwd_group_n: int = 8
    bwd_num_warps: int = 8
    bwd_num_stages: int = 4
    bwd_v_chunks: int = 16
    bwd_de_chunk_bytes: int = 8 << 20
    bwd_filter_by_max: int = 0
    bwd_workspace_bytes: int = 64 << 20
    bwd_dense_gemm: int = 1
    dense_min_cols: int = 1024
    ws_block_do: int = 128

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if not isinstance(value, int) or value < (0 if name in _MAY_BE_ZERO else 1):
                raise ValueError(f"KernelConfig.{name} must be a positive int, got {value!r}")
        for name in ("fwd_block_n", "fwd_block_v", "fwd_block_d", "bwd_block_n", "bwd_block_v", "bwd_block_d", "ws_block_do"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")


# Under TRITON_INTERPRET every program runs as numpy code: small blocks keep the odd test shapes
# spread over several tiles (so masking is exercised) without making the interpreter crawl.
INTERPRETER_CONFIG = KernelConfig(
    fwd_block_n=16, fwd_block_v=64, fwd_block_d=32, fwd_programs=8, fwd_num_warps=4, fwd_num_stages=1,
    bwd_block_n=16, bwd_block_v=64, bwd_block_d=32, bwd_group_n=2, bwd_num_warps=4, bwd_num_stages=1,
    bwd_v_chunks=3, bwd_de_chunk_bytes=4096, bwd_workspace_bytes=6000, ws_block_do=32, fwd_chunk_bytes=6000,
    dense_min_cols=64,
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
    if device.type != "cuda":
        cfg = INTERPRETER_CONFIG
    else:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        cfg = replace(KernelConfig(), fwd_programs=4 * sms)
        if dtype.itemsize == 4:
            # fp32 tiles take twice the shared memory per pipeline stage: halve their depth in D
            # (3 x 2 x 128 x 128 x 4 bytes would pass the 227 KB a Hopper block can have).
            cfg = replace(cfg, fwd_block_d=cfg.fwd_block_d // 2, bwd_block_d=cfg.bwd_block_d // 2)
    text = os.environ.get(_ENV_OVERRIDE)
    return replace(cfg, **_env_override(text)) if text else cfg
