"""Triton kernels only: no autograd, no torch.distributed."""

from cce_parallel.kernels.backward import cce_backward
from cce_parallel.kernels.backward_ws import cce_backward_ws, ws_scale
from cce_parallel.kernels.from_logits import dz_from_logits, stats_from_logits, stats_slices
from cce_parallel.kernels.config import KernelConfig, default_config
from cce_parallel.kernels.lse_forward import lse_forward

__all__ = [
    "KernelConfig",
    "cce_backward",
    "cce_backward_ws",
    "default_config",
    "dz_from_logits",
    "lse_forward",
    "stats_from_logits",
    "stats_slices",
    "ws_scale",
]
