"""Autograd, dispatch and the PyTorch reference; builds on kernels/."""

from cce_parallel.ops.functional import IMPLS, REDUCTIONS, linear_cross_entropy
from cce_parallel.ops.module import LinearCrossEntropy

__all__ = ["IMPLS", "REDUCTIONS", "LinearCrossEntropy", "linear_cross_entropy"]
