"""Triton kernels only: no autograd, no torch.distributed."""

from cce_parallel.kernels.config import KernelConfig, default_config
from cce_parallel.kernels.from_logits import (
    dz_from_logits,
    dz_rows_in_place,
    grad_scale,
    stats_from_logits,
    stats_slices,
)
from cce_parallel.kernels.probs_gemm import grad_rows, logits_probs
from cce_parallel.kernels.scaled import SNAP_ULPS, scale_, scaled_copy, snap_ratio
from cce_parallel.kernels.target_rows import add_rows_summed, fold_rows, scale_sub_rows
from cce_parallel.kernels.weighted_grads import weighted_grads

__all__ = [
    "SNAP_ULPS",
    "KernelConfig",
    "add_rows_summed",
    "default_config",
    "dz_from_logits",
    "dz_rows_in_place",
    "fold_rows",
    "grad_rows",
    "grad_scale",
    "logits_probs",
    "scale_",
    "scale_sub_rows",
    "scaled_copy",
    "snap_ratio",
    "stats_from_logits",
    "stats_slices",
    "weighted_grads",
]
