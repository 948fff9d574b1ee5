"""Autograd, dispatch and the PyTorch reference for one device; builds on kernels/."""

from cce_parallel.ops.functional import IMPLS, REDUCTIONS, linear_cross_entropy

__all__ = ["IMPLS", "REDUCTIONS", "linear_cross_entropy"]
