"""Autograd, dispatch and the PyTorch reference for one device; builds on kernels/."""

from cce_parallel.ops.functional import IMPLS, REDUCTIONS, linear_cross_entropy
from cce_parallel.ops.upstream import UpstreamState

__all__ = ["IMPLS", "REDUCTIONS", "UpstreamState", "linear_cross_entropy"]
