"""Triton kernels only: no autograd, no torch.distributed."""

from cce_parallel.kernels.backward import cce_backward
from cce_parallel.kernels.backward_ws import cce_backward_ws, cce_dlogits_ws, ws_scale
from cce_parallel.kernels.config import KernelConfig, default_config
from cce_parallel.kernels.lse_forward import lse_forward

__all__ = ["KernelConfig", "cce_backward", "cce_backward_ws", "cce_dlogits_ws", "default_config", "lse_forward", "ws_scale"]
